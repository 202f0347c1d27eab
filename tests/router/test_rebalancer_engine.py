"""The rebalancer end to end, in this process (no Ray): a router in front of two real SmolLM2
workers, rebalancing on. Three long requests run on w0 alone (w1 not yet a member); once w1 joins,
the rebalancer sees w0's KV usage far above w1's and moves requests there by live migration, one
at a time; every stream completes with exactly the tokens of an unrebalanced run."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from testkit.router_fakes import LoopThread

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

PROMPT = ("A lighthouse keeper lived alone on a small island in the north sea. Every evening he climbed the "
          "stairs, wound the clockwork and lit the lamp, and every morning he wrote one line in his log. ")


@pytest.fixture(scope="module")
def setup(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    workers = [lt.run(start_worker_server(config, worker_id=f"w{i}"), timeout=600) for i in range(2)]
    router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, policy="least_loaded",
                                       load_poll_interval_s=0.1, rebalance=True, rebalance_interval_s=0.3,
                                       rebalance_kv_gap=0.15), [("w0", workers[0].endpoint)], tokenizer=tok)
    try:
        yield router, workers
    finally:
        router.stop(0)
        for w in workers:
            lt.run(w.stop(grace=1))
        lt.close()


def _run_all(address: str, n: int, on_start=None) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                req = duet_pb2.GenerateRequest(prompt=f"{PROMPT} Entry {i}:", sampling=duet_pb2.SamplingParams(
                    max_tokens=48, temperature=0, ignore_eos=True))
                for r in duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=300):
                    out[i] += r.token_ids
        except grpc.RpcError as e:
            errors.append(f"{e.code().name}: {e.details()}")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if on_start is not None:
        on_start(out)
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def _load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def test_a_hot_worker_sheds_requests_to_a_new_cool_one(setup):
    router, (w0, w1) = setup
    want = _run_all(router.address, 3)  # w0 alone: nothing to rebalance to

    def join_w1(out):
        deadline = time.monotonic() + 120
        while not all(len(t) >= 4 for t in out):
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.05)
        router.set_members([("w0", w0.endpoint), ("w1", w1.endpoint)])

    got = _run_all(router.address, 3, join_w1)
    assert got == want
    moves = router.stats()["requests"].get("rebalance_moves", 0)
    assert moves >= 1 and _load(w1.endpoint).migrations_in == moves
    assert _load(w0.endpoint).kv_blocks_used == 0 and _load(w1.endpoint).kv_blocks_used == 0
