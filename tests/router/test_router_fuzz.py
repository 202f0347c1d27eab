"""Fuzzing the public gRPC API: hypothesis-generated duet.v1 requests (huge, empty, out-of-range,
NaN and malformed fields), raw bytes that are not a valid message (including invalid UTF-8 in
string fields), and a cancellation storm. The router must answer every one with a well-formed
status (never UNKNOWN or INTERNAL: those mean an unhandled exception) and keep serving.

Reproducible: hypothesis runs derandomized (a fixed seed), so CI sees the same cases every run.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from hypothesis import given
from testkit.router_fakes import members, run_async

from benchmarks.fuzz_requests import ALLOWED, call_status, fuzz, fuzz_settings, malformed, raw_generate, requests

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router

FUZZ = fuzz_settings(200)
seen: Counter[str] = Counter()  # statuses over every fuzz case of this module (reported at the end)


@pytest.fixture(scope="module")
def router(smollm2_path, tok, pool):
    cfg = RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, max_model_len=512, policy="prefix_aware",
                       load_poll_interval_s=0.05)
    with serve_router(cfg, members(pool), tokenizer=tok) as handle:
        yield handle


@pytest.fixture(scope="module")
def channel(router):
    with grpc.insecure_channel(router.address) as ch:
        yield ch


def _still_serving(channel) -> None:
    req = duet_pb2.GenerateRequest(prompt="Hello", sampling=duet_pb2.SamplingParams(max_tokens=3, temperature=0))
    assert call_status(duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=10))[0] == grpc.StatusCode.OK


@FUZZ
@given(req=requests())
def test_fuzzed_requests_get_well_formed_statuses(channel, req):
    code, details = call_status(duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=10))
    seen[code.name] += 1
    assert code in ALLOWED, (code, details, req)
    assert code == grpc.StatusCode.OK or details, "an error status must say what is wrong"


@FUZZ
@given(data=malformed())
def test_malformed_bytes_are_invalid_argument(channel, data):
    code, details = call_status(raw_generate(channel)(data, timeout=10))
    seen[f"raw {code.name}"] += 1
    assert code in ALLOWED, (code, details, data)


def test_invalid_utf8_prompt_is_invalid_argument_naming_the_problem(channel):
    code, details = call_status(raw_generate(channel)(b"\x0a\x02\xff\xfe", timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in details


def test_cancellation_storm_leaves_the_router_serving(router, channel, pool):
    async def storm() -> int:
        ch = grpc.aio.insecure_channel(router.address)
        stub = duet_pb2_grpc.DuetStub(ch)
        req = duet_pb2.GenerateRequest(prompt="Tell me a story", sampling=duet_pb2.SamplingParams(max_tokens=64))
        calls = [stub.Generate(req, timeout=10) for _ in range(200)]
        for i, call in enumerate(calls):  # cancel at once, after a message, or never
            if i % 3 == 0:
                call.cancel()
            elif i % 3 == 1:
                await call.read()
                call.cancel()
        codes = await asyncio.gather(*(_finish(c) for c in calls))
        await ch.close()
        return sum(c == grpc.StatusCode.CANCELLED for c in codes)

    for s in pool:
        s.worker.reset()
        s.worker.delay_s = 0.002
    try:
        cancelled = run_async(storm(), timeout=60)
    finally:
        for s in pool:
            s.worker.reset()
    assert cancelled >= 130
    _still_serving(channel)
    # every worker call the storm started has ended (the router cancelled what the clients cancelled)
    from testkit.router_fakes import wait_until

    wait_until(lambda: all(s.worker.active == 0 for s in pool), timeout=10, what="worker calls to end")


async def _finish(call) -> grpc.StatusCode:
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except asyncio.CancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


def test_fuzz_runner_reports_every_case(router):
    report = fuzz(router.address, cases=20)  # the benchmark's runner, on the fakes: all well formed
    assert report["cases"] == 40 and sum(report["statuses"].values()) == 40
    assert report["ill_formed"] == [] and report["serving_after"]


def test_router_serves_after_fuzzing(channel):
    _still_serving(channel)
    assert seen, "the fuzz tests ran before this one"
    print("statuses seen while fuzzing:", dict(seen))
