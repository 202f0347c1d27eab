"""The node's shared host tier through real workers (two SmolLM2 worker servers in this process, one
node, ``cache.host_tier_shared``): a conversation one worker evicted into the node's tier is a host
hit on the other worker, and on a worker restarted on the node; the greedy tokens equal a worker's
with tiers off; the restarted worker reports the node tier's blocks as its host holdings; stopping
every worker leaves no shared-memory file."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import grpc
import pytest
from testkit.node_tier import node_dirs, private_node_root
from testkit.router_fakes import LoopThread

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.block_hash import Tier, chain_hashes
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

KV_BYTES = 16 << 20  # 22 blocks of 16 tokens with fp32 KV (352 tokens), 45 with bf16
SYSTEM = [1, 9690, 198] + list(range(2000, 2125))  # 128 tokens: 8 blocks
TURN1 = SYSTEM + list(range(3000, 3030))
FILLERS = [list(range(5000 + 400 * i, 5300 + 400 * i)) for i in range(3)]  # 3 x 20 blocks: more than the cache


def _submit(endpoint: str, rid: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(endpoint) as channel:
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=worker_pb2.SamplingParams(
            max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True))
        return [t for r in worker_pb2_grpc.WorkerStub(channel).Submit(req, timeout=300) for t in r.token_ids]


def _host_hits(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).tier_host_hits


def _reported_tiers(endpoint: str) -> dict[int, int]:
    """The blocks a worker reports holding now (a snapshot of its block events): hash -> tier."""
    with grpc.insecure_channel(endpoint) as channel:
        r = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(block_events=True), timeout=10)
    return dict(zip(r.blocks_stored, r.blocks_stored_tiers or [Tier.DEVICE] * len(r.blocks_stored)))


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Turns 1, 2 and 3 computed by a worker with tiers off (the plain path)."""
    lt = LoopThread()
    plain = lt.run(start_worker_server(EngineConfig(model=str(smollm2_path), cache=CacheConfig(
        kv_cache_memory_bytes=KV_BYTES)), worker_id="plain"), timeout=600)
    try:
        out1 = _submit(plain.endpoint, "r1", TURN1)
        turn2 = TURN1 + out1 + list(range(3100, 3130))
        out2 = _submit(plain.endpoint, "r2", turn2)
        turn3 = turn2 + out2 + list(range(3200, 3230))
        out3 = _submit(plain.endpoint, "r3", turn3)
    finally:
        lt.run(plain.stop(grace=1))
        lt.close()
    gc.collect()
    return [(TURN1, out1), (turn2, out2), (turn3, out3)]


def test_workers_of_a_node_share_the_host_tier_and_a_restarted_one_reuses_it(smollm2_path, reference):
    with private_node_root() as root:
        _share_and_restart(smollm2_path, reference, root)


def _share_and_restart(smollm2_path, reference, root: Path) -> None:
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(
        kv_cache_memory_bytes=KV_BYTES, host_tier_bytes=64 << 20, host_tier_shared=True, host_tier_dir=str(root)))
    lt = LoopThread()
    workers = [lt.run(start_worker_server(config, worker_id=f"w{i}"), timeout=600) for i in range(2)]
    try:
        (turn1, out1), (turn2, out2), (turn3, out3) = reference
        assert _submit(workers[0].endpoint, "t1", turn1) == out1
        for i, filler in enumerate(FILLERS):  # push the conversation out of w0's device cache: into the node tier
            _submit(workers[0].endpoint, f"f{i}", filler)
        assert len(node_dirs(root)) == 1
        # w1 never saw the conversation: it loads it from the node's tier instead of computing it
        before = _host_hits(workers[1].endpoint)
        assert _submit(workers[1].endpoint, "t2", turn2) == out2
        assert _host_hits(workers[1].endpoint) - before >= len(SYSTEM) // 16
        # w0 stops (gracefully: it leaves the tier, w1 still uses it) and a new worker takes its place
        lt.run(workers[0].stop(grace=1))
        workers[0] = lt.run(start_worker_server(config, worker_id="w0"), timeout=600)
        for i, filler in enumerate(FILLERS):  # and w1's copy of turn 2 goes down to the node tier too
            _submit(workers[1].endpoint, f"g{i}", filler)
        # the restarted worker reports the node tier's blocks (its own report, not only w1's): the
        # node feed's pass at start, then every second, names turn 2's blocks in host
        want = chain_hashes(turn2, 16)[: len(turn2) // 16 - 1]
        deadline = time.monotonic() + 20
        while any(_reported_tiers(workers[0].endpoint).get(h) != Tier.HOST for h in want):
            assert time.monotonic() < deadline, "the restarted worker does not report the node tier's blocks"
            time.sleep(0.1)
        assert _submit(workers[0].endpoint, "t3", turn3) == out3
        assert _host_hits(workers[0].endpoint) >= len(turn2) // 16 - 1  # the restarted worker reused it
    finally:
        for w in workers:
            lt.run(w.stop(grace=1))
        lt.close()
    gc.collect()
    assert node_dirs(root) == []  # the last worker out removed the node tier
