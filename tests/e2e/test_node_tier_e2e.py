"""The node's shared host tier through ``duet serve`` (the session's local Ray cluster, one CPU worker,
``host_tier_shared``): a conversation evicted from the worker's device cache into the node's tier
survives the worker being killed; the worker Ray restarts on the node loads it back (host hits)
and decodes the same greedy tokens as a worker with tiers off; stopping the deployment leaves no
shared-memory file."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import complete
from testkit.node_tier import node_dirs, private_node_root

KV_BYTES = 16 << 20  # 22 blocks of 16 tokens with fp32 KV (352 tokens), 45 with bf16
NAMESPACE = "duet_e2e_nodetier"
SYSTEM = [1, 9690, 198] + list(range(2000, 2125))  # 128 tokens: 8 blocks
TURN1 = SYSTEM + list(range(3000, 3030))
FILLERS = [list(range(5000 + 400 * i, 5300 + 400 * i)) for i in range(3)]  # 3 x 20 blocks: more than the cache


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Turns 1 and 2 computed by a worker with tiers off (the plain path), in this process."""
    from testkit.router_fakes import LoopThread

    from workers.config import CacheConfig, EngineConfig
    from workers.server.service import start_worker_server

    lt = LoopThread()
    plain = lt.run(start_worker_server(EngineConfig(model=str(smollm2_path), cache=CacheConfig(
        kv_cache_memory_bytes=KV_BYTES)), worker_id="plain"), timeout=600)

    def submit(rid: str, ids: list[int]) -> list[int]:
        with grpc.insecure_channel(plain.endpoint) as channel:
            req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=worker_pb2.SamplingParams(
                max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True))
            return [t for r in worker_pb2_grpc.WorkerStub(channel).Submit(req, timeout=300) for t in r.token_ids]

    try:
        out1 = submit("r1", TURN1)
        turn2 = TURN1 + out1 + list(range(3100, 3130))
        out2 = submit("r2", turn2)
    finally:
        lt.run(plain.stop(grace=1))
        lt.close()
    gc.collect()
    return out1, turn2, out2


def test_a_killed_worker_restarted_on_the_node_reuses_the_node_tier(ray_cluster, smollm2_path, reference):
    with private_node_root() as root:
        _restart_reuses(smollm2_path, reference, root)


def _restart_reuses(smollm2_path, reference, root: Path) -> None:
    out1, turn2, out2 = reference
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "pool.replicas": 1, "pool.cpus_per_replica": 1,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "pool.engine.host_tier_bytes": 64 << 20,
        "pool.engine.host_tier_shared": True, "pool.engine.host_tier_dir": str(root), "router.port": 0, "router.http_port": 0, "controller.port": 0,
        "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config)
    try:
        def generate(ids: list[int]) -> list[int]:
            return list(complete(token_ids=ids, target=d.address, max_tokens=8, temperature=0, ignore_eos=True,
                                 timeout=120).token_ids)

        assert generate(TURN1) == out1
        for filler in FILLERS:  # the conversation leaves the device cache: into the node's tier
            generate(filler)
        assert len(node_dirs(root)) == 1
        [(victim, endpoint)] = d.controller.members()
        ray.kill(d.pool.replica(victim).actor, no_restart=False)  # a crash: Ray restarts it on this node
        assert d.controller.wait_for(lambda m: dict(m).get(victim) not in (None, endpoint), timeout=240), \
            d.controller.describe()
        new_endpoint = dict(d.controller.members())[victim]
        deadline = time.monotonic() + 60
        while True:  # the router re-adds the restarted worker
            try:
                got = generate(turn2)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert got == out2
        with grpc.insecure_channel(new_endpoint) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load.tier_host_hits >= len(SYSTEM) // 16, load  # the new process loaded what the old one left
        assert load.tier_refused_corrupt == load.tier_refused_foreign == 0
    finally:
        d.stop()
    assert node_dirs(root) == []  # the last user out removed the node's tier
