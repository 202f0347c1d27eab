"""Pending holdings across routers, with real SmolLM2 workers (in this process, no Ray): a prefix
sent through one router is seen by another router as held *pending* on the chosen worker while that
worker has not computed it yet (it waits behind a running request: one sequence at a time), and the
other router sends the same prefix there too, before any load poll (polls are 60 s apart here).
Once the worker computed the prompt, both routers see it on the device."""

from __future__ import annotations

import threading

import grpc
import pytest
from testkit.router_fakes import LoopThread, router_config, wait_until

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.server import serve_router
from workers.block_hash import Tier
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.server.service import start_worker_server

STEM = ("A lighthouse keeper lived alone on a small island in the north sea. Every evening he climbed the "
        "stairs, wound the clockwork and lit the lamp, and every morning he wrote one line in his log. ")


@pytest.fixture(scope="module")
def cluster(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=1))
    workers = [lt.run(start_worker_server(config, worker_id=f"w{i}"), timeout=600) for i in range(2)]
    members = [(w.worker_id, w.endpoint) for w in workers]
    routers = [serve_router(router_config(smollm2_path, policy="prefix_aware", load_poll_interval_s=60.0),
                            members, tokenizer=tok) for _ in range(2)]
    try:
        yield routers, workers
    finally:
        for r in routers:
            r.stop(0)
        for w in workers:
            lt.run(w.stop(grace=1))
        lt.close()


def _stream(address: str, ids: list[int], max_tokens: int, first: threading.Event | None = None) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=ids),
                                       sampling=duet_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True))
        out = []
        for r in duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=300):
            out.extend(r.token_ids)
            if first is not None:
                first.set()
        return out


class _set_on_exit:
    """Set the event however the blocker ends (a failed one must not leave the test waiting)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self.event.set()


def _block(endpoint: str, started: threading.Event) -> None:
    """Occupy the worker's one sequence slot for a while (a direct Submit, no router involved)."""
    with grpc.insecure_channel(endpoint) as channel, _set_on_exit(started):
        req = worker_pb2.SubmitRequest(request_id=f"blocker-{endpoint}", prompt_token_ids=list(range(300, 340)),
                                       sampling=worker_pb2.SamplingParams(max_tokens=48, temperature=0.0, top_p=1.0,
                                                                          ignore_eos=True))
        for _ in worker_pb2_grpc.WorkerStub(channel).Submit(req, timeout=300):
            started.set()


def test_a_prefix_one_router_sent_is_pending_in_the_others_view_before_it_is_computed(cluster, tok):
    routers, workers = cluster
    wait_until(lambda: all(w.healthy for r in routers for w in r.server.directory.snapshot()), timeout=30,
               what="both workers routable from both routers")
    started = [threading.Event() for _ in workers]
    blockers = [threading.Thread(target=_block, args=(w.endpoint, s)) for w, s in zip(workers, started)]
    for t in blockers:
        t.start()
    for s in started:
        assert s.wait(60), "a blocker never started"
    assert all(t.is_alive() for t in blockers), "a blocker ended before the test's request"
    ids = tok(STEM)["input_ids"]
    n = len(ids) // 16
    first = threading.Event()
    sent = threading.Thread(target=_stream, args=(routers[0].address, ids + tok(" First entry:")["input_ids"], 2,
                                                  first))
    sent.start()
    try:
        other = routers[1].server
        wait_until(lambda: other.prefix_index.match_tiers(ids), timeout=30, what="router 1 sees a holder")
        view = other.prefix_index.match_tiers(ids)
        assert not first.is_set(), "the worker computed the prompt before router 1 looked"
        (holder, tiers), = view.items()
        assert tiers == [Tier.PENDING] * n, view  # held pending: admitted, not computed
        assert other.prefix_index.match(ids) == {}  # nothing a pull could read yet
        # router 1 sends the same prefix where it is being computed, though it never sent it anywhere
        hits = other.pipeline.policy.counters()["prefix_hits"]
        second = threading.Thread(target=_stream, args=(routers[1].address, ids + tok(" Second entry:")["input_ids"], 2))
        second.start()
        wait_until(lambda: other.pipeline.policy.counters()["prefix_hits"] == hits + 1, timeout=30,
                   what="router 1 routed on the pending holding")
        assert other.pipeline.policy.counters()["matched_pending_blocks"] >= n
        second.join(300)
    finally:
        sent.join(300)
        for t in blockers:
            t.join(300)
    for r in routers:  # computed: both routers see it on the holder's device, pending gone
        wait_until(lambda r=r: r.server.prefix_index.match_tiers(ids).get(holder) == [Tier.DEVICE] * n, timeout=10,
                   what="the prefix on the holder's device")
