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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import members, pool, run_async, tok  # noqa: F401  (pool, tok: shared fixtures)

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
seen: Counter[str] = Counter()  # statuses over every fuzz case of this module (reported at the end)

U32 = st.integers(0, 2**32 - 1)
text = st.one_of(st.text(max_size=40), st.text(max_size=3000), st.sampled_from(["", " ", "\x00", "\ud7ff", "🙂" * 50]))
floats = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def requests(draw) -> duet_pb2.GenerateRequest:
    req = duet_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(st.one_of(text, st.just("x" * draw(st.integers(0, 30_000)))))
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 60_000), U32), max_size=600)))
    elif kind == "messages":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "", "tool",
                                                                      "🙂"]), text), max_size=6)):
            req.messages.messages.add(role=role, content=content)
    if draw(st.booleans()):
        req.request_id = draw(st.text(max_size=300))
    if draw(st.booleans()):
        req.model = draw(st.sampled_from(["", "SmolLM2-135M-Instruct", "other", "x" * 1000]))
    s = req.sampling
    if draw(st.booleans()):
        s.max_tokens = draw(st.one_of(st.integers(0, 8), U32))
    if draw(st.booleans()):
        s.temperature = draw(floats)
    if draw(st.booleans()):
        s.top_p = draw(floats)
    s.top_k = draw(st.one_of(st.just(0), U32))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    s.stop_token_ids.extend(draw(st.lists(U32, max_size=5)))
    s.ignore_eos = draw(st.booleans())
    return req


@pytest.fixture(scope="module")
def router(smollm2_path, tok, pool):
    cfg = RouterConfig(tokenizer_path=str(smollm2_path), port=0, max_model_len=512, policy="prefix_aware",
                       load_poll_interval_s=0.05)
    with serve_router(cfg, members(pool), tokenizer=tok) as handle:
        yield handle


@pytest.fixture(scope="module")
def channel(router):
    with grpc.insecure_channel(router.address) as ch:
        yield ch


def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _still_serving(channel) -> None:
    req = duet_pb2.GenerateRequest(prompt="Hello", sampling=duet_pb2.SamplingParams(max_tokens=3, temperature=0))
    assert _status(duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=10))[0] == grpc.StatusCode.OK


@FUZZ
@given(req=requests())
def test_fuzzed_requests_get_well_formed_statuses(channel, req):
    code, details = _status(duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=10))
    seen[code.name] += 1
    assert code in ALLOWED, (code, details, req)
    assert code == grpc.StatusCode.OK or details, "an error status must say what is wrong"


@FUZZ
@given(data=st.one_of(st.binary(max_size=2000),
                      # field 1 (prompt, a string) holding bytes that are not UTF-8
                      st.binary(min_size=1, max_size=200).map(lambda b: b"\x0a" + bytes([len(b[:127])]) + b[:127])
                      .filter(lambda b: not _is_utf8(b[2:]))))
def test_malformed_bytes_are_invalid_argument(channel, data):
    raw = channel.unary_stream("/duet.v1.Duet/Generate", request_serializer=lambda b: b,
                               response_deserializer=duet_pb2.GenerateResponse.FromString)
    code, details = _status(raw(data, timeout=10))
    seen[f"raw {code.name}"] += 1
    assert code in ALLOWED, (code, details, data)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_invalid_utf8_prompt_is_invalid_argument_naming_the_problem(channel):
    raw = channel.unary_stream("/duet.v1.Duet/Generate", request_serializer=lambda b: b,
                               response_deserializer=duet_pb2.GenerateResponse.FromString)
    code, details = _status(raw(b"\x0a\x02\xff\xfe", timeout=10))
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
    from router_fakes import wait_until

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


def test_router_serves_after_fuzzing(channel):
    _still_serving(channel)
    assert seen, "the fuzz tests ran before this one"
    print("statuses seen while fuzzing:", dict(seen))
