"""Disaggregated routing: the (prefill, decode) pair choice (router/policies/disagg.py), and the
pipeline's handling of it against fake workers: the Submit names the prefill worker, short prompts
stay colocated, a failed prefill half (ABORTED) is retried once colocated on the decode worker, and with
none left the client gets UNAVAILABLE."""

from __future__ import annotations

import asyncio
import concurrent.futures

import grpc
import pytest
from testkit.router_fakes import FakeWorker, FakeWorkerServer, LoopThread, SCRIPT, run_async, wait_until

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.policies import NoWorkersAvailable, RouteRequest, WorkerState, make_policy
from router.policies.disagg import DisaggRouter, Route
from router.server import serve_router


def ws(wid: str, role: str, load: int = 0, healthy: bool = True) -> WorkerState:
    return WorkerState(wid, f"{wid}:1", healthy=healthy, role=role, outstanding_tokens=load, kv_block_size=16)


def router(min_prompt_tokens: int = 64) -> DisaggRouter:
    return DisaggRouter(make_policy("least_loaded"), block_size=16, min_prompt_tokens=min_prompt_tokens)


def req(n: int, rid: str = "r", base: int = 0) -> RouteRequest:
    return RouteRequest(rid, [base + i for i in range(n)], 8)


def test_without_prefill_workers_it_is_the_plain_policy():
    r = router()
    workers = [ws("c0", "colocated", 500), ws("c1", "colocated", 100)]
    assert r.select(req(1000), workers) == Route("c1")
    assert r.counters()["disagg_routes"] == 0 and r.counters()["no_prefill_fallbacks"] == 0


def test_short_prompts_stay_colocated_long_ones_get_a_pair():
    r = router(min_prompt_tokens=64)
    workers = [ws("d0", "decode", 100), ws("d1", "decode", 50), ws("p0", "prefill", 0)]
    assert r.select(req(63), workers) == Route("d1")
    assert r.select(req(64), workers) == Route("d1", "p0")
    assert r.counters()["colocated_short"] == 1 and r.counters()["disagg_routes"] == 1


def test_prefill_choice_weighs_prefix_overlap_against_load():
    r = router(min_prompt_tokens=0)
    workers = [ws("d0", "decode"), ws("p0", "prefill", 0), ws("p1", "prefill", 16 * 10)]
    assert r.select(req(800, "a", base=1), workers).prefill_id == "p0"
    # p0 now holds the 50-block prefix: a busier p0 (load 20 blocks < 50 matched) still wins ...
    busy = [ws("d0", "decode"), ws("p0", "prefill", 16 * 20), ws("p1", "prefill", 0)]
    assert r.select(req(800, "b", base=1), busy).prefill_id == "p0"
    # ... until its queue outweighs what the prefix saves.
    swamped = [ws("d0", "decode"), ws("p0", "prefill", 16 * 80), ws("p1", "prefill", 0)]
    assert r.select(req(800, "c", base=1), swamped).prefill_id == "p1"
    # a different prompt has no overlap anywhere: the idler prefill worker takes it
    assert r.select(req(800, "d", base=10_000), busy).prefill_id == "p1"


def test_unhealthy_prefill_falls_back_colocated_and_a_retry_runs_colocated():
    r = router(min_prompt_tokens=0)
    workers = [ws("d0", "decode"), ws("p0", "prefill", healthy=False)]
    assert r.select(req(100), workers) == Route("d0")
    assert r.counters()["no_prefill_fallbacks"] == 1
    # after a prefill failure: colocated, even with a prefill worker that looks healthy (it may
    # share the failed one's node, and the router learns that only when its polls fail)
    assert r.select(req(100), workers, require_prefill=True) == Route("d0")
    assert r.select(req(100), [*workers, ws("p1", "prefill")], require_prefill=True) == Route("d0")
    assert r.counters()["retry_colocated"] == 2 and r.counters()["disagg_routes"] == 0
    with pytest.raises(NoWorkersAvailable):
        r.select(req(100), [ws("p0", "prefill")])  # nobody to decode


def lora(wid: str, role: str, load: int = 0, adapters: tuple[str, ...] = (), max_loaded: int = 4) -> WorkerState:
    return WorkerState(wid, f"{wid}:1", healthy=True, role=role, outstanding_tokens=load, kv_block_size=16,
                       adapters=frozenset(adapters), max_loaded_adapters=max_loaded)


def test_prefill_prefers_a_worker_holding_the_adapter_like_decode():
    """The prefill side follows the decode side's adapter rule (router/policies/adapter_affinity.py):
    a holder unless overloaded, else the least-loaded worker; only workers that serve adapters."""
    r = DisaggRouter(make_policy("least_loaded"), block_size=16, min_prompt_tokens=0)
    sql = lambda rid, base=0: RouteRequest(rid, [base + i for i in range(320)], 8, adapter="sql")  # noqa: E731
    workers = [lora("d0", "decode"), lora("p0", "prefill", 0), lora("p1", "prefill", 2000, ("sql",)),
               lora("p2", "prefill", 0, max_loaded=0)]
    assert r.select(sql("a"), workers) == Route("d0", "p1")  # the holder, though p0 (and p2) are idler
    assert r.select(req(320, "base", base=5_000), workers).prefill_id in ("p0", "p2")  # no adapter: by cost
    # the holder overloaded (beyond +4096 tokens and x1.5 over the least loaded): the least-loaded
    # prefill worker that serves adapters loads it -- never p2, which serves none
    swamped = [lora("d0", "decode"), lora("p0", "prefill", 100), lora("p1", "prefill", 9000, ("sql",)),
               lora("p2", "prefill", 0, max_loaded=0)]
    assert r.select(sql("b", base=10_000), swamped) == Route("d0", "p0")
    # nobody holds it: the least loaded that serves adapters
    cold = [lora("d0", "decode"), lora("p0", "prefill", 500), lora("p1", "prefill", 100),
            lora("p2", "prefill", 0, max_loaded=0)]
    assert r.select(sql("c", base=20_000), cold) == Route("d0", "p1")
    # no prefill worker serves adapters: colocated on the decode worker (a counted fallback)
    assert r.select(sql("d"), [lora("d0", "decode"), lora("p2", "prefill", max_loaded=0)]) == Route("d0")
    c = r.counters()
    assert (c["prefill_adapter_hits"], c["prefill_adapter_overload_fallbacks"], c["prefill_adapter_cold"],
            c["prefill_no_adapter_fallbacks"]) == (1, 1, 1, 1)


def test_prefill_adapter_choice_equals_the_plain_path_without_adapters():
    """Equivalence with the plain path: requests without an adapter route exactly as before, whatever
    adapters the workers hold (the adapter rule only narrows the candidates of adapter requests)."""
    plain, aware = router(min_prompt_tokens=0), router(min_prompt_tokens=0)
    held = [lora("d0", "decode", 30), lora("p0", "prefill", 0, ("sql",)), lora("p1", "prefill", 16 * 10)]
    bare = [ws("d0", "decode", 30), ws("p0", "prefill", 0), ws("p1", "prefill", 16 * 10)]
    for i, base in enumerate((1, 1, 10_000, 1, 20_000)):
        assert aware.select(req(800, f"r{i}", base=base), held) == plain.select(req(800, f"r{i}", base=base), bare)


class DecodeFake(FakeWorker):
    """A decode worker double: fails the Submit with ABORTED when its remote_prefill names a
    worker in ``bad_prefill`` (as a real decode worker does when the prefill half fails)."""

    bad_prefill: set[str] = set()
    stall_on: set[str] = set()  # wait forever, as when the prefill worker vanished silently

    async def Submit(self, request, context):
        if request.HasField("remote_prefill") and request.remote_prefill.worker_id in self.stall_on:
            self.submitted.append(request)
            await asyncio.sleep(3600)
        if request.HasField("remote_prefill") and request.remote_prefill.worker_id in self.bad_prefill:
            self.submitted.append(request)
            await context.abort(grpc.StatusCode.ABORTED, f"remote prefill failed: {request.remote_prefill.worker_id}")
        async for msg in super().Submit(request, context):
            yield msg


@pytest.fixture(scope="module")
def cluster(smollm2_path, tok):
    lt = LoopThread()
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    decode = FakeWorkerServer(lt, DecodeFake("d0", ids, tok.eos_token_id))
    prefills = [FakeWorkerServer(lt, FakeWorker(f"p{i}", ids, tok.eos_token_id)) for i in range(2)]
    for s in (decode, *prefills):
        s.start()
    members = [("d0", decode.endpoint, "decode")] + [(s.worker.worker_id, s.endpoint, "prefill") for s in prefills]
    config = RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, policy="least_loaded", load_poll_interval_s=0.05,
                          disagg_min_prompt_tokens=32, stream_failure_cooldown_s=0.0, load_poll_timeout_s=0.3)
    handle = serve_router(config, members)
    wait_until(lambda: all(w["healthy"] for w in handle.server.directory.describe()), what="workers healthy")
    yield handle, decode, prefills
    handle.stop()
    for s in (decode, *prefills):
        s.stop_sync()
    lt.close()


async def generate(address: str, prompt: str):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = duet_pb2_grpc.DuetStub(channel)
        return [m async for m in stub.Generate(duet_pb2.GenerateRequest(prompt=prompt, sampling=duet_pb2.SamplingParams(
            max_tokens=4)))]


def test_pipeline_names_the_prefill_worker_and_retries_a_failed_prefill_once(cluster):
    handle, decode, prefills = cluster
    dw = decode.worker
    dw.submitted.clear()
    run_async(generate(handle.address, "short prompt"))
    assert not dw.submitted[-1].HasField("remote_prefill")  # below disagg_min_prompt_tokens

    long_prompt = "word " * 64
    run_async(generate(handle.address, long_prompt))
    rp = dw.submitted[-1].remote_prefill
    chosen = next(s for s in prefills if s.worker.worker_id == rp.worker_id)
    assert (rp.endpoint, rp.incarnation) == (chosen.endpoint, chosen.incarnation)

    DecodeFake.bad_prefill = {"p0", "p1"}
    try:
        dw.submitted.clear()
        for i in range(3):  # each prefill failure is retried once, colocated on the decode worker
            out = run_async(generate(handle.address, f"{i} " + long_prompt))
            assert out[-1].finish_reason != duet_pb2.FINISH_REASON_UNSPECIFIED
        routes = [r.remote_prefill.worker_id if r.HasField("remote_prefill") else None for r in dw.submitted]
        # every failed disaggregated attempt is followed by its colocated retry (a request routed once
        # both prefill workers are reported runs colocated at once)
        assert routes[0] in ("p0", "p1") and all(b is None for a, b in zip(routes, routes[1:]) if a is not None), routes
        assert handle.server.pipeline.counts["prefill_failures"] >= 1
    finally:
        DecodeFake.bad_prefill = set()


def test_a_silently_vanished_prefill_worker_cancels_the_wait_and_retries(cluster):
    handle, decode, prefills = cluster
    dw, p0 = decode.worker, prefills[0]
    wait_until(lambda: all(w["healthy"] for w in handle.server.directory.describe()), what="workers healthy")
    DecodeFake.stall_on = {"p0"}
    try:
        dw.submitted.clear()
        pending: concurrent.futures.Future = concurrent.futures.ThreadPoolExecutor(1).submit(
            run_async, generate(handle.address, "a prompt nobody sent before " * 8))
        wait_until(lambda: any(r.remote_prefill.worker_id == "p0" for r in dw.submitted), what="routed via p0")
        p0.worker.hang = True  # GetLoad stops answering: the router declares p0 dead after 3 polls
        out = pending.result(timeout=30)
        assert out[-1].finish_reason != duet_pb2.FINISH_REASON_UNSPECIFIED
        assert not dw.submitted[-1].HasField("remote_prefill")  # retried colocated on the decode worker
    finally:
        DecodeFake.stall_on = set()
        p0.worker.hang = False
