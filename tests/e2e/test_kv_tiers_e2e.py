"""KV tiers through ``duet serve`` (the session's local Ray cluster, one worker of 1 CPU, the
router on a free port, the public gRPC API): a multi-turn workload whose history outgrows a 16 MiB
device cache decodes the same greedy tokens as the engine run directly with tiers off, the worker's
GetLoad reports host and disk hits, and stopping the deployment leaves no disk-tier file."""

from __future__ import annotations

import gc
from pathlib import Path

import grpc
import pytest

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import complete

KV_BYTES = 16 << 20  # 22 blocks of 16 tokens (SmolLM2, fp32): 352 tokens
NAMESPACE = "duet_e2e_kvtiers"
SYSTEM = [1, 9690, 198] + list(range(2000, 2190))  # + 4 x 3 turns of 30 user and 8 output tokens: > 352


def turns() -> list[tuple[int, list[int]]]:
    """(conversation, user tokens) for 4 conversations x 3 turns, round robin."""
    return [(c, list(range(3000 + 100 * c + 30 * t, 3000 + 100 * c + 30 * t + 30))) for t in range(3) for c in range(4)]


def run(generate) -> list[list[int]]:
    hist = {c: SYSTEM + [500 + c] for c in range(4)}
    outs = []
    for c, user in turns():
        hist[c] += user
        out = generate(hist[c])
        outs.append(out)
        hist[c] += out
    return outs


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    engines = [LLM(str(smollm2_path), kv_cache_memory_bytes=KV_BYTES)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = run(lambda ids: list(engines[0].generate([ids], params)[0].token_ids))
    engines.clear()  # free the engine before the deployment starts its worker
    gc.collect()
    return outs


def test_served_multi_turn_with_tiers_equals_the_engine_without(ray_cluster, smollm2_path, reference,
                                                               tmp_path: Path):
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "pool.replicas": 1, "pool.cpus_per_replica": 1,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "pool.engine.host_tier_bytes": 4 << 20,
        "pool.engine.disk_tier_bytes": 256 << 20, "pool.engine.disk_tier_dir": str(tmp_path),
        "pool.engine.tier_load_timeout_s": 60.0, "router.port": 0, "router.http_port": 0, "controller.port": 0,
        "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config)
    try:
        served = run(lambda ids: list(complete(token_ids=ids, target=d.address, max_tokens=8, temperature=0,
                                               ignore_eos=True, timeout=120).token_ids))
        [(_, endpoint)] = d.controller.members()
        with grpc.insecure_channel(endpoint) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    finally:
        d.stop()
    assert served == reference
    assert load.tier_host_hits > 0 and load.tier_disk_hits > 0 and load.tier_bytes_to_disk > 0, load
    assert load.tier_refused_corrupt == load.tier_refused_foreign == 0
    assert list(tmp_path.iterdir()) == []  # the worker removed its disk directory at shutdown
