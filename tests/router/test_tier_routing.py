"""Routing on KV tiers through real components: a router (prefix_aware, membership over gRPC) in front
of two real SmolLM2 workers with a host KV tier and a small device cache, in this process (no Ray).
A conversation's prefix evicted from its worker's device into host memory is reported there as a
host-tier holding (block events with the tier), the router sends the next turn to that worker (a
host hit, counted), the worker loads the prefix back instead of computing it, and the greedy tokens
equal those of the other worker computing the whole prompt."""

from __future__ import annotations


import grpc
import pytest
from testkit.router_fakes import LoopThread, wait_until

from cluster.deploy.membership_service import serve_membership
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.block_hash import Tier
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server
from testkit.static_controller import StaticController

KV_BYTES = 16 << 20  # 22 blocks of 16 tokens with fp32 KV (352 tokens), 45 with bf16
SYSTEM = [1, 9690, 198] + list(range(2000, 2125))  # 128 tokens: 8 blocks


@pytest.fixture(scope="module")
def cluster(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path),
                          cache=CacheConfig(kv_cache_memory_bytes=KV_BYTES, host_tier_bytes=64 << 20))
    workers = [lt.run(start_worker_server(config, worker_id=f"w{i}"), timeout=600) for i in range(2)]
    service = serve_membership(StaticController([(w.worker_id, w.endpoint) for w in workers]), "127.0.0.1", 0)
    router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, policy="prefix_aware",
                                       load_poll_interval_s=0.05, membership_address=service.address,
                                       membership_wait_s=10.0), [], tokenizer=tok)
    try:
        yield router, workers
    finally:
        router.stop(0)
        service.stop()
        for w in workers:
            lt.run(w.stop(grace=1))
        lt.close()


def _generate(address: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=ids),
                                       sampling=duet_pb2.SamplingParams(max_tokens=8, temperature=0.0))
        return [t for r in duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=300) for t in r.token_ids]


def _submit(endpoint: str, rid: str, ids: list[int]) -> list[int]:
    """Straight to one worker (not through the router)."""
    with grpc.insecure_channel(endpoint) as channel:
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids,
                                       sampling=worker_pb2.SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0))
        return [t for r in worker_pb2_grpc.WorkerStub(channel).Submit(req, timeout=300) for t in r.token_ids]


def _load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def test_a_prefix_evicted_to_host_is_routed_to_its_host_and_loaded_back(cluster):
    router, workers = cluster
    index = router.server.prefix_index
    policy = router.server.pipeline.policy
    wait_until(lambda: all(index.knows(w.worker_id) for w in workers), what="both workers reported", timeout=30)
    turn1 = SYSTEM + list(range(3000, 3030))
    out1 = _generate(router.address, turn1)
    wait_until(lambda: index.match(SYSTEM), what="the router sees the holder", timeout=10)
    (holder,) = index.match(SYSTEM)
    other = next(w for w in workers if w.worker_id != holder)
    host = next(w for w in workers if w.worker_id == holder)
    # other traffic on the holder pushes the conversation out of its device cache
    for i in range(3):  # 3 x 20 blocks: more than the cache with fp32 KV (22 blocks) or bf16 (45)
        _submit(host.endpoint, f"filler{i}", list(range(5000 + 400 * i, 5300 + 400 * i)))
    wait_until(lambda: index.match_tiers(SYSTEM).get(holder, [])[:1] == [Tier.HOST],
               what="the router sees the prefix in the holder's host tier", timeout=10)
    assert set(index.match_tiers(SYSTEM)[holder]) == {Tier.HOST}  # reported as moved, not lost
    assert other.worker_id not in index.match(SYSTEM)
    before = _load(host.endpoint).tier_host_hits
    host_blocks = policy.counters()["matched_host_blocks"]
    turn2 = turn1 + out1 + list(range(3100, 3130))
    got = _generate(router.address, turn2)
    assert policy.counters()["matched_host_blocks"] - host_blocks >= len(SYSTEM) // 16  # routed on the host hit
    assert _load(host.endpoint).tier_host_hits - before >= len(SYSTEM) // 16  # ...to the worker that loaded it
    assert got == _submit(other.endpoint, "plain", turn2)  # same greedy tokens as computing the whole prompt
