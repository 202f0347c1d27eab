"""Hypothesis strategies over the public duet.v1 API, and a fuzz runner for a live router.

Strategies: ``requests()`` builds GenerateRequests with every field drawn from its valid, edge
and invalid values (empty, huge, out of range, NaN and infinity, unknown models, 20 stop strings
of 300 characters, token ids up to 2**32-1); ``malformed()`` draws raw bytes that are not a valid
GenerateRequest, including a prompt field holding bytes that are not UTF-8.

A well-formed answer is a status in ``ALLOWED`` (never UNKNOWN or INTERNAL, which mean an
unhandled exception in the server), with a message whenever it is an error. Runs are derandomized
(a fixed seed): the same cases every time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.duet.v1 import duet_pb2, duet_pb2_grpc

ALLOWED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.CANCELLED})

U32 = st.integers(0, 2**32 - 1)
_text = st.one_of(st.text(max_size=40), st.text(max_size=3000),
                  st.sampled_from(["", " ", "\x00", "\ud7ff", "🙂" * 50]))
_floats = st.floats(allow_nan=True, allow_infinity=True)


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def requests(draw: Any) -> duet_pb2.GenerateRequest:
    req = duet_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(st.one_of(_text, st.just("x" * draw(st.integers(0, 30_000)))))
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 60_000), U32), max_size=600)))
    elif kind == "messages":
        roles = st.sampled_from(["user", "system", "assistant", "", "tool", "🙂"])
        for role, content in draw(st.lists(st.tuples(roles, _text), max_size=6)):
            req.messages.messages.add(role=role, content=content)
    if draw(st.booleans()):
        req.request_id = draw(st.text(max_size=300))
    if draw(st.booleans()):
        req.model = draw(st.sampled_from(["", "SmolLM2-135M-Instruct", "other", "x" * 1000]))
    s = req.sampling
    if draw(st.booleans()):
        s.max_tokens = draw(st.one_of(st.integers(0, 8), U32))
    if draw(st.booleans()):
        s.temperature = draw(_floats)
    if draw(st.booleans()):
        s.top_p = draw(_floats)
    s.top_k = draw(st.one_of(st.just(0), U32))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    s.stop_token_ids.extend(draw(st.lists(U32, max_size=5)))
    s.ignore_eos = draw(st.booleans())
    return req


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def malformed() -> st.SearchStrategy[bytes]:
    """Random bytes, and field 1 (prompt, a string) holding bytes that are not UTF-8."""
    bad_prompt = (st.binary(min_size=1, max_size=127).filter(lambda b: not _is_utf8(b))
                  .map(lambda b: b"\x0a" + bytes([len(b)]) + b))
    return st.one_of(st.binary(max_size=2000), bad_prompt)


def call_status(call: Any) -> tuple[grpc.StatusCode, str]:
    """Drain a streaming call; its final status code and details."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def raw_generate(channel: grpc.Channel) -> Any:
    return channel.unary_stream("/duet.v1.Duet/Generate", request_serializer=lambda b: b,
                                response_deserializer=duet_pb2.GenerateResponse.FromString)


def fuzz(address: str, *, cases: int, timeout: float = 30.0) -> dict[str, Any]:
    """``cases`` generated requests and ``cases`` malformed payloads against the router at
    ``address``; returns the statuses seen and the cases answered outside ALLOWED (must be none)."""
    seen: Counter[str] = Counter()
    bad: list[str] = []
    with grpc.insecure_channel(address) as channel:
        stub, raw = duet_pb2_grpc.DuetStub(channel), raw_generate(channel)

        @fuzz_settings(cases)
        @given(req=requests())
        def generated(req: duet_pb2.GenerateRequest) -> None:
            code, details = call_status(stub.Generate(req, timeout=timeout))
            seen[code.name] += 1
            if code not in ALLOWED or (code != grpc.StatusCode.OK and not details):
                bad.append(f"{code.name}: {details!r} for {str(req)[:300]!r}")

        @fuzz_settings(cases)
        @given(data=malformed())
        def raw_bytes(data: bytes) -> None:
            code, details = call_status(raw(data, timeout=timeout))
            seen[f"raw {code.name}"] += 1
            if code not in ALLOWED:
                bad.append(f"raw {code.name}: {details!r} for {data[:100]!r}")

        generated()
        raw_bytes()
        ok = call_status(stub.Generate(duet_pb2.GenerateRequest(
            prompt="Hello", sampling=duet_pb2.SamplingParams(max_tokens=3, temperature=0)), timeout=timeout))[0]
    return {"cases": 2 * cases, "statuses": dict(seen), "ill_formed": bad,
            "serving_after": ok == grpc.StatusCode.OK}
