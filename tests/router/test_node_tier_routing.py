"""Routing on the node's shared host tier through real components: a router (prefix_aware) in front
of two real SmolLM2 workers of one node sharing their host tier (``cache.host_tier_shared``), in
this process (no Ray). A conversation worker w0 evicted into the node tier is reported by w1 too
(w1 never computed it: the node tier's change feed), the router sends the next turn to w1 while w0
is busy, w1 loads the prefix from the node tier instead of computing it, and the greedy tokens
equal a worker's with tiers off. A block deleted from the node tier stops being reported by both
without any lookup."""

from __future__ import annotations

import threading
from contextlib import nullcontext
from pathlib import Path

import grpc
import pytest
from testkit.node_tier import node_dirs, private_node_root
from testkit.router_fakes import LoopThread, wait_until
from testkit.static_controller import StaticController

from cluster.deploy.membership_service import serve_membership
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.block_hash import Tier, chain_hashes
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

KV_BYTES = 16 << 20  # 22 blocks of 16 tokens with fp32 KV (352 tokens), 45 with bf16
SYSTEM = [1, 9690, 198] + list(range(2200, 2325))  # 128 tokens: 8 blocks
TURN1 = SYSTEM + list(range(3000, 3030))
FILLERS = [list(range(5000 + 400 * i, 5300 + 400 * i)) for i in range(3)]  # 3 x 20 blocks: more than the cache
# room for every block both tests evict (~170 blocks, ~60 MiB with bf16 KV, twice that with fp32): the
# node tier's own LRU never deletes what a test waits to see reported
NODE_BYTES = 512 << 20


@pytest.fixture(scope="module")
def cluster(smollm2_path, tok):
    with private_node_root() as root:
        yield from _cluster(smollm2_path, tok, root)


def _cluster(smollm2_path, tok, root: Path):
    lt = LoopThread()
    shared = EngineConfig(model=str(smollm2_path), cache=CacheConfig(
        kv_cache_memory_bytes=KV_BYTES, host_tier_bytes=NODE_BYTES, host_tier_shared=True, host_tier_dir=str(root)))
    workers = [lt.run(start_worker_server(shared, worker_id=f"w{i}"), timeout=600) for i in range(2)]
    plain = lt.run(start_worker_server(EngineConfig(model=str(smollm2_path), cache=CacheConfig(
        kv_cache_memory_bytes=KV_BYTES)), worker_id="plain"), timeout=600)  # tiers off: the reference
    service = serve_membership(StaticController([(w.worker_id, w.endpoint) for w in workers]), "127.0.0.1", 0)
    router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, policy="prefix_aware",
                                       load_poll_interval_s=0.05, membership_address=service.address,
                                       membership_wait_s=10.0), [], tokenizer=tok)
    try:
        yield router, workers, plain, root
    finally:
        router.stop(0)
        service.stop()
        for w in [*workers, plain]:
            lt.run(w.stop(grace=1))
        lt.close()
    assert node_dirs(root) == []  # the last worker out removed the node tier


def _generate(address: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=ids),
                                       sampling=duet_pb2.SamplingParams(max_tokens=8, temperature=0.0))
        return [t for r in duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=300) for t in r.token_ids]


def _submit(endpoint: str, rid: str, ids: list[int], max_tokens: int = 8,
            channel: grpc.Channel | None = None) -> list[int]:
    """Straight to one worker (not through the router); on ``channel`` if given (closing it cancels the call)."""
    with nullcontext(channel) if channel is not None else grpc.insecure_channel(endpoint) as channel:
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=worker_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=max_tokens > 8))
        return [t for r in worker_pb2_grpc.WorkerStub(channel).Submit(req, timeout=300) for t in r.token_ids]


def _try(f, *args):
    try:
        return len(f(*args))
    except Exception as e:  # noqa: BLE001 - reported in the assertion's message
        return repr(e)


def _load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def _load_tokens(router, worker_id: str) -> int:
    return next(int(m["load_tokens"]) for m in router.server.directory.describe() if m["worker_id"] == worker_id)


def test_a_prefix_a_neighbour_put_in_the_node_tier_is_routed_on_and_loaded(cluster):
    router, (w0, w1), plain, _ = cluster
    holder, neighbour = w1, w0  # the neighbour also wins a tie (same match, same load) by its id
    index = router.server.prefix_index
    policy = router.server.pipeline.policy
    wait_until(lambda: all(index.knows(w.worker_id) for w in (w0, w1)), what="both workers reported", timeout=30)
    out1 = _submit(holder.endpoint, "t1", TURN1)  # the holder alone computes turn 1...
    for i, filler in enumerate(FILLERS):  # ...and pushes it out of its device cache into the node tier
        _submit(holder.endpoint, f"f{i}", filler)
    turn2 = TURN1 + out1 + list(range(3100, 3130))
    # the neighbour never saw the conversation; the node tier's feed makes it report the prefix in
    # host: every block the holder reports of it (the feed's pass may trail the holder's own events)
    wait_until(lambda: (m := index.match_tiers(turn2)).get("w0", [])[:8] == [Tier.HOST] * 8
               and m.get("w0") == m.get("w1"), what="the neighbour reports the node tier's copy", timeout=60)
    assert index.match_tiers(SYSTEM)["w1"] == [Tier.HOST] * 8
    # the holder gets busy: the router weighs the two equal host hits against load, picks the neighbour
    busy_out: list = []
    busy_channel = grpc.insecure_channel(holder.endpoint)
    busy = threading.Thread(target=lambda: busy_out.append(
        _try(_submit, holder.endpoint, "busy", list(range(7000, 7040)), 200, busy_channel)))  # 15 blocks: fits the cache
    busy.start()
    try:
        wait_until(lambda: _load_tokens(router, "w1") > 100, what="the router sees the holder busy", timeout=20)
        before, before_holder = _load(neighbour.endpoint).tier_host_hits, _load(holder.endpoint).tier_host_hits
        host_blocks = policy.counters()["matched_host_blocks"]
        seen = (index.match_tiers(turn2), [(m["worker_id"], m["healthy"], m["load_tokens"])
                                           for m in router.server.directory.describe()])
        got = _generate(router.address, turn2)
        assert policy.counters()["matched_host_blocks"] - host_blocks >= len(SYSTEM) // 16  # routed on the hit
        why = (f"busy: {busy_out}; the holder loaded {_load(holder.endpoint).tier_host_hits - before_holder} host "
               f"blocks instead; the router saw tiers {seen[0]} and workers {seen[1]} just before; "
               f"policy {policy.counters()}")
        assert _load(neighbour.endpoint).tier_host_hits - before >= len(SYSTEM) // 16, why  # loaded from the node tier
        assert got == _submit(plain.endpoint, "plain", turn2)  # the tokens of computing it all, tiers off
    finally:
        busy_channel.close()  # the busy request only had to keep the holder busy while turn 2 was routed
        busy.join()


def test_a_block_deleted_from_the_node_tier_stops_being_reported_by_every_worker(cluster):
    router, (w0, w1), _, root = cluster
    index = router.server.prefix_index
    turn = [1, 9690, 198] + list(range(8000, 8090))  # 93 tokens: 5 full blocks
    _submit(w0.endpoint, "d1", turn)
    for i, filler in enumerate(FILLERS):
        _submit(w0.endpoint, f"g{i}", filler)
    hashes = chain_hashes(turn, 16)
    wait_until(lambda: all(index.match_tiers(turn).get(w, [])[:1] == [Tier.HOST] for w in ("w0", "w1")),
               what="both report the prefix in host", timeout=60)
    (node_dir,) = node_dirs(root)
    for path in node_dir.glob("*.kvb"):  # the node tier loses every block (another worker's eviction pass)
        path.unlink()
    # no lookup happens: the feed reports the removal within its interval (1 s), the router drops it
    wait_until(lambda: not any(index.match_tiers(turn).get(w) for w in ("w0", "w1")),
               what="no worker still claims the deleted prefix", timeout=60)
    assert not any(h in set(_reported(w.endpoint)) for h in hashes for w in (w0, w1))  # the workers' own reports


def _reported(endpoint: str) -> list[int]:
    """The blocks a worker reports holding now, in any tier (a snapshot of its block events)."""
    with grpc.insecure_channel(endpoint) as channel:
        report = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(block_events=True), timeout=10)
    return list(report.blocks_stored)
