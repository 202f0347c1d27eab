"""Several routers, active-active, in front of the same two real SmolLM2 workers (in this process, no
Ray): each follows the controller's member list over gRPC (cluster/deploy/membership_service.py) and
reads the workers' prefix-cache block events on its load polls (router/prefix_index.py). A prefix
one router sent lands, through the *other* router, on the worker that holds it -- a router that
never sent it anywhere -- and every router's index agrees with what the workers hold."""

from __future__ import annotations

import time

import grpc
import pytest
from testkit.router_fakes import LoopThread, wait_until

from cluster.deploy.membership_service import serve_membership
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server
from testkit.static_controller import StaticController

STEM = ("A lighthouse keeper lived alone on a small island in the north sea. Every evening he climbed the "
        "stairs, wound the clockwork and lit the lamp, and every morning he wrote one line in his log. ")
OTHER = ("The river town held a market every Thursday: fishermen sold their catch by the bridge, bakers "
         "brought bread from the hills, and children ran between the stalls until the bells rang noon. ")


@pytest.fixture(scope="module")
def cluster(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    workers = [lt.run(start_worker_server(config, worker_id=f"w{i}"), timeout=600) for i in range(2)]
    service = serve_membership(StaticController([(w.worker_id, w.endpoint) for w in workers]), "127.0.0.1", 0)
    routers = [serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, policy="prefix_aware",
                                         load_poll_interval_s=0.05, membership_address=service.address,
                                         membership_wait_s=10.0), [], tokenizer=tok) for _ in range(2)]
    try:
        yield routers, workers
    finally:
        for r in routers:
            r.stop(0)
        service.stop()
        for w in workers:
            lt.run(w.stop(grace=1))
        lt.close()


def _generate(address: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=ids),
                                       sampling=duet_pb2.SamplingParams(max_tokens=2, temperature=0.0))
        return [t for r in duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=120) for t in r.token_ids]


def _hits(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).prefix_cache_hits


def test_a_prefix_sent_through_one_router_is_routed_to_its_holder_by_the_other(cluster, tok):
    routers, workers = cluster
    assert all(sorted(w["worker_id"] for w in r.stats()["workers"]) == ["w0", "w1"] for r in routers)
    for sender, other, stem in ((0, 1, STEM), (1, 0, OTHER)):
        ids = tok(stem)["input_ids"]
        _generate(routers[sender].address, ids + tok(" First entry:")["input_ids"])
        indexes = [r.server.prefix_index for r in routers]
        wait_until(lambda ids=ids, indexes=indexes: all(ix.match(ids) for ix in indexes),
                   what="both routers see the holder", timeout=10)
        holders = [ix.match(ids) for ix in indexes]
        assert holders[0] == holders[1] and len(holders[0]) == 1, holders  # the same view, one holder
        holder, blocks = next(iter(holders[0].items()))
        assert blocks == len(ids) // 16
        endpoint = next(w.endpoint for w in workers if w.worker_id == holder)
        before = _hits(endpoint)
        policy = routers[other].server.pipeline.policy
        hits = policy.counters()["prefix_hits"]
        _generate(routers[other].address, ids + tok(" Second entry:")["input_ids"])
        assert policy.counters()["prefix_hits"] == hits + 1  # routed on the reported holding...
        assert _hits(endpoint) - before >= blocks  # ...to the worker that reused it
        assert policy.counters()["tree_blocks"] == 0  # no per-router guess was kept


def test_every_router_reports_the_same_holdings_as_the_workers(cluster):
    routers, workers = cluster
    time.sleep(0.3)  # a few polls after the last request
    for w in workers:
        with grpc.insecure_channel(w.endpoint) as channel:
            held = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(block_events=True),
                                                               timeout=10).blocks_stored
        assert [r.server.prefix_index.num_blocks(w.worker_id) for r in routers] == [len(held)] * len(routers)
