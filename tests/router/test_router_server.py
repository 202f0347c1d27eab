"""The router's gRPC server against in-process fake workers (tests/testkit/router_fakes.py): the
request path, validation, admission, cancellation and deadlines, worker failures, membership,
health, ListModels and reflection. The fakes replay the real SmolLM2 tokenization of a script
with multi-byte characters, so incremental detokenization and stop strings are the real thing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from testkit.router_fakes import SCRIPT, members, run_async, wait_until

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig, RouterConfigError
from router.server import serve_router

MAX_MODEL_LEN = 512
S = duet_pb2.SamplingParams


def _config(path, **overrides) -> RouterConfig:
    fields = dict(tokenizer_path=str(path), port=0, http_port=0, max_model_len=MAX_MODEL_LEN, policy="round_robin",
                  load_poll_interval_s=0.05, load_poll_timeout_s=0.5, worker_failure_threshold=2,
                  stream_failure_cooldown_s=0.3)
    fields.update(overrides)
    return RouterConfig(**fields)


@pytest.fixture(scope="module")
def router(smollm2_path, tok, pool):
    handle = serve_router(_config(smollm2_path), members(pool), tokenizer=tok)
    yield handle
    handle.stop(0)


def _all_healthy(router, n=2) -> bool:
    ws = router.stats()["workers"]
    return len(ws) == n and all(w["healthy"] for w in ws)


@pytest.fixture(autouse=True)
def clean_pool(pool, router):
    """Every test starts with both fake workers up, SERVING, reset, and healthy in the router."""
    for s in pool:
        s.worker.reset()
        if not s.running:
            s.start()
        s.set_serving(True)
    router.set_members(members(pool))
    wait_until(lambda: _all_healthy(router), what="both workers healthy")
    yield


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield duet_pb2_grpc.DuetStub(channel)


def _script_ids(tok) -> list[int]:
    return tok.encode(SCRIPT, add_special_tokens=False) + [tok.eos_token_id]


def _error(stub, request, timeout=10.0) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=timeout))
    return info.value


def _submitted(pool) -> Counter:
    return Counter({s.worker.worker_id: len(s.worker.submitted) for s in pool})


# ------------------------------------------------------------------ the request path
def test_stream_text_ids_finish_and_usage(stub, pool, tok):
    script = _script_ids(tok)
    req = duet_pb2.GenerateRequest(prompt="Hello", request_id="client-1", sampling=S(max_tokens=100))
    responses = list(stub.Generate(req, timeout=10))
    assert len(responses) > 10  # streamed, not buffered
    assert all(r.request_id == "client-1" for r in responses)
    assert all("\ufffd" not in r.text for r in responses)  # never half a UTF-8 character
    assert "".join(r.text for r in responses) == SCRIPT
    assert [t for r in responses for t in r.token_ids] == script  # including EOS
    assert all(not r.HasField("finish_reason") for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == duet_pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(tok.encode("Hello")), len(script))
    sent = [r for s in pool for r in s.worker.submitted]
    assert len(sent) == 1 and list(sent[0].prompt_token_ids) == tok.encode("Hello")
    assert sent[0].request_id != "client-1"  # workers see the router's unique internal id


def test_defaults_filled_and_request_id_generated(stub, pool, tok):
    responses = list(stub.Generate(duet_pb2.GenerateRequest(prompt="Hi"), timeout=10))
    rid = responses[0].request_id
    assert rid and all(r.request_id == rid for r in responses)
    (sent,) = [r for s in pool for r in s.worker.submitted]
    assert sent.request_id == rid  # router-assigned id = internal id, so logs line up
    p = sent.sampling
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.HasField("seed")) == (16, 1.0, 1.0, 0, False)
    assert responses[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 16


def test_explicit_sampling_passes_through_and_clamps_to_context(stub, pool, tok):
    prompt_ids = list(range(100, 100 + MAX_MODEL_LEN - 10))
    req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=prompt_ids), sampling=S(
        max_tokens=1000, temperature=0.0, top_p=0.5, top_k=7, seed=3, stop_token_ids=[5], ignore_eos=True))
    list(stub.Generate(req, timeout=10))
    (sent,) = [r for s in pool for r in s.worker.submitted]
    p = sent.sampling
    assert list(sent.prompt_token_ids) == prompt_ids
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop_token_ids), p.ignore_eos) == (
        10, 0.0, 0.5, 7, 3, [5], True)


def test_multi_token_deltas_and_max_tokens(stub, pool, tok):
    for s in pool:
        s.worker.tokens_per_message = 3
    responses = list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=20)), timeout=10))
    ids = [t for r in responses for t in r.token_ids]
    assert ids == _script_ids(tok)[:20]
    # An incomplete character at the cut is dropped, never sent as U+FFFD.
    assert "".join(r.text for r in responses) == tok.decode(ids).rstrip("\ufffd")
    assert responses[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("per_message", [1, 4])
def test_stop_string_cut_never_leaked_and_worker_cancelled(stub, pool, tok, per_message):
    for s in pool:
        s.worker.tokens_per_message, s.worker.delay_s = per_message, 0.01  # still streaming at the stop
    req = duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=100, stop=["fox jumps", "zzz"]))
    responses = list(stub.Generate(req, timeout=10))
    text = "".join(r.text for r in responses)
    assert text == SCRIPT[: SCRIPT.index("fox jumps")]
    assert not any("fox" in r.text or r.text.endswith(" f") for r in responses)
    ids = [t for r in responses for t in r.token_ids]
    assert tok.decode(ids).endswith("fox jumps")  # ids include the ones spelling the stop string
    assert responses[-1].finish_reason == duet_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == len(ids)
    # The fake ignores stop strings, so the router must cancel the worker call itself.
    worker = next(s.worker for s in pool if s.worker.submitted)
    assert worker.cancelled_event.wait(30)  # an event: a pass returns at once; 30 s for an overloaded host


def test_messages_use_the_chat_template(stub, pool, tok):
    msgs = [duet_pb2.ChatMessage(role="system", content="Be brief."),
            duet_pb2.ChatMessage(role="user", content="What is 2+2?")]
    req = duet_pb2.GenerateRequest(messages=duet_pb2.ChatMessages(messages=msgs))
    list(stub.Generate(req, timeout=10))
    (sent,) = [r for s in pool for r in s.worker.submitted]
    text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs],
                                   add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert list(sent.prompt_token_ids) == tok.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------ bad input
_LONG = "word " * (MAX_MODEL_LEN + 10)
BAD = [
    ("no_input", duet_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("empty_prompt", duet_pb2.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("empty_ids", duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt_token_ids"),
    ("id_outside_vocab", duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=[1, 10**6])),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]"),
    ("empty_messages", duet_pb2.GenerateRequest(messages=duet_pb2.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT,
     "messages"),
    ("empty_role", duet_pb2.GenerateRequest(messages=duet_pb2.ChatMessages(
        messages=[duet_pb2.ChatMessage(content="x")])), grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role"),
    ("too_long", duet_pb2.GenerateRequest(prompt=_LONG), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("too_long_ids", duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=[5] * MAX_MODEL_LEN)),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ("max_tokens_0", duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens"),
    ("temperature_neg", duet_pb2.GenerateRequest(prompt="x", sampling=S(temperature=-0.5)),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ("temperature_nan", duet_pb2.GenerateRequest(prompt="x", sampling=S(temperature=math.nan)),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ("top_p_0", duet_pb2.GenerateRequest(prompt="x", sampling=S(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_p"),
    ("top_p_big", duet_pb2.GenerateRequest(prompt="x", sampling=S(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_p"),
    ("seed_big", duet_pb2.GenerateRequest(prompt="x", sampling=S(seed=2**63)), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.seed"),
    ("too_many_stops", duet_pb2.GenerateRequest(prompt="x", sampling=S(stop=[f"s{i}" for i in range(17)])),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
    ("long_stop", duet_pb2.GenerateRequest(prompt="x", sampling=S(stop=["ok", "y" * 257])),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop[1]"),
    ("empty_stop", duet_pb2.GenerateRequest(prompt="x", sampling=S(stop=[""])), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.stop[0]"),
    ("stop_id_outside_vocab", duet_pb2.GenerateRequest(prompt="x", sampling=S(stop_token_ids=[2, 10**7])),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop_token_ids[1]"),
    ("request_id_long", duet_pb2.GenerateRequest(prompt="x", request_id="r" * 300), grpc.StatusCode.INVALID_ARGUMENT,
     "request_id"),
    ("unknown_model", duet_pb2.GenerateRequest(prompt="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "model"),
]


@pytest.mark.parametrize(("request_", "code", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_rejected_before_routing(stub, pool, request_, code, field):
    err = _error(stub, request_)
    assert err.code() == code
    assert err.details().startswith(f"{field}:"), err.details()
    assert sum(_submitted(pool).values()) == 0  # never reached a worker


def test_default_model_name_accepted(stub, router):
    req = duet_pb2.GenerateRequest(prompt="x", model=router.server.config.model_name)
    assert list(stub.Generate(req, timeout=10))[-1].HasField("finish_reason")


def test_worker_invalid_argument_passes_through(stub, pool):
    for s in pool:
        s.worker.fail = (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: 300 tokens, this worker's limit is 255")
    err = _error(stub, duet_pb2.GenerateRequest(prompt="x"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "prompt_token_ids: 300 tokens, this worker's limit is 255"


# ------------------------------------------------------------------ routing and concurrency
def test_a_stopped_router_answers_calls_at_once(smollm2_path, tok, pool):
    """After stop(), the handle's calls (stats for /metrics and the in-process autoscaler,
    set_members) fail at once naming the router, instead of waiting out their timeout for an event
    loop that no longer runs."""
    handle = serve_router(_config(smollm2_path), members(pool), tokenizer=tok)
    assert "requests" in handle.stats()
    handle.stop()
    started = time.monotonic()
    for call in (handle.stats, lambda: handle.set_members(members(pool))):
        with pytest.raises(RuntimeError, match=f"the router on {handle.address} is stopped"):
            call()
    assert time.monotonic() - started < 1.0
    handle.stop()  # idempotent


def test_round_robin_alternates(stub, pool):
    for _ in range(6):
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=2)), timeout=10))
    assert _submitted(pool) == Counter({"w0": 3, "w1": 3})


@pytest.mark.parametrize("policy", ["least_loaded", "prefix_aware"])
def test_policies_spread_concurrent_requests(smollm2_path, tok, pool, policy):
    with serve_router(_config(smollm2_path, policy=policy), members(pool), tokenizer=tok) as r:
        for s in pool:
            s.worker.delay_s = 0.01
        prompts = [f"{i} distinct prompt number {i} " * 3 for i in range(8)]
        run_async(_concurrent(r.address, [duet_pb2.GenerateRequest(prompt=p, sampling=S(max_tokens=8))
                                            for p in prompts]))
        counts = _submitted(pool)
        assert sum(counts.values()) == 8 and min(counts["w0"], counts["w1"]) >= 2, counts
        if policy == "prefix_aware":  # one long shared prefix keeps going where it is cached
            shared = "You are a helpful assistant. " * 20
            for s in pool:
                s.worker.reset()
            for i in range(4):
                list(duet_pb2_grpc.DuetStub(grpc.insecure_channel(r.address)).Generate(
                    duet_pb2.GenerateRequest(prompt=shared + str(i), sampling=S(max_tokens=2)), timeout=10))
            assert sorted(_submitted(pool).values()) == [0, 4]
            assert r.stats()["policy"]["prefix_hits"] >= 3


async def _concurrent(address: str, requests: list[duet_pb2.GenerateRequest], timeout: float = 20.0):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = duet_pb2_grpc.DuetStub(channel)

        async def one(req):
            return [r async for r in stub.Generate(req, timeout=timeout)]
        return await asyncio.gather(*(one(r) for r in requests))


def test_sixteen_concurrent_streaming_clients_all_complete(router, pool, tok):
    for s in pool:
        s.worker.delay_s = 0.005
    reqs = [duet_pb2.GenerateRequest(prompt=f"client {i}", request_id=f"c{i}", sampling=S(max_tokens=30))
            for i in range(16)]
    results = run_async(_concurrent(router.address, reqs))
    expected = tok.decode(_script_ids(tok)[:30], skip_special_tokens=True).rstrip("\ufffd")
    for i, responses in enumerate(results):
        assert {r.request_id for r in responses} == {f"c{i}"}
        assert "".join(r.text for r in responses) == expected
        assert responses[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH
    assert _submitted(pool) == Counter({"w0": 8, "w1": 8})
    wait_until(lambda: router.stats()["admission"]["in_flight"] == 0, what="in-flight back to 0")


def test_overload_is_rejected_fast(smollm2_path, tok, pool):
    for s in pool:
        s.worker.delay_s = 0.2
    with serve_router(_config(smollm2_path, max_in_flight=2, max_queue=1), members(pool), tokenizer=tok) as r:
        async def scenario():
            async with grpc.aio.insecure_channel(r.address) as channel:
                stub = duet_pb2_grpc.DuetStub(channel)
                calls = [stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=40)), timeout=20)
                         for _ in range(3)]
                admission = r.server.pipeline.admission
                while (admission.in_flight, admission.queued) != (2, 1):  # 2 streaming + 1 queued
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Generate(duet_pb2.GenerateRequest(prompt="x"), timeout=20).read()
                elapsed = time.monotonic() - t0
                for c in calls:
                    c.cancel()
                await asyncio.gather(*(c.code() for c in calls))  # let grpc finish them on this loop
                return info.value, elapsed
        err, elapsed = run_async(scenario())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_in_flight=2" in err.details() and "max_queue=1" in err.details()
        assert elapsed < 0.5
        wait_until(lambda: r.stats()["admission"]["in_flight"] == 0, what="slots released after cancel")
        assert r.stats()["admission"]["rejected"] == 1


# ------------------------------------------------------------------ cancellation and deadlines
def test_client_cancel_aborts_the_worker_call(router, pool):
    for s in pool:
        s.worker.delay_s = 0.05

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = duet_pb2_grpc.DuetStub(channel).Generate(
                duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=45)), timeout=20)
            for _ in range(3):
                await call.read()
            call.cancel()
    run_async(scenario())
    worker = next(s.worker for s in pool if s.worker.submitted)
    assert worker.cancelled_event.wait(30)  # an event: a pass returns at once; 30 s for an overloaded host
    assert worker.cancelled == [worker.submitted[0].request_id]
    wait_until(lambda: router.stats()["admission"]["in_flight"] == 0 and worker.active == 0, what="cleanup")


def test_deadline_propagates_to_the_worker(stub, pool):
    for s in pool:
        s.worker.delay_s = 0.05
    t0 = time.monotonic()
    err = _error(stub, duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=45)), timeout=0.5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2
    worker = next(s.worker for s in pool if s.worker.submitted)
    (deadline,) = worker.deadlines.values()
    assert deadline is not None and deadline < 0.6  # the worker call carries the client's deadline
    assert worker.cancelled_event.wait(30)  # an event: a pass returns at once; 30 s for an overloaded host


# ------------------------------------------------------------------ worker failures
def test_worker_death_mid_stream_resumes_on_another_worker(router, stub, pool, tok):
    full = list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=40)), timeout=10))
    wait_until(lambda: _all_healthy(router), what="both workers healthy")
    for s in pool:
        s.worker.reset()
    pool[0].worker.die_after, pool[0].worker.die_mode = 3, "abort"  # w0 dies after 3 tokens; w1 is fine
    pool[0].worker.delay_s = pool[1].worker.delay_s = 0.005
    resumed_before = router.stats()["requests"].get("resumed", 0)
    for _ in range(2):  # round robin: one of the two requests starts on w0
        out = list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=40)), timeout=10))
        # one uninterrupted stream for the client: the same ids, text, finish reason and usage
        assert [t for r in out for t in r.token_ids] == [t for r in full for t in r.token_ids]
        assert "".join(r.text for r in out) == "".join(r.text for r in full)
        assert out[-1].finish_reason == full[-1].finish_reason and out[-1].usage.completion_tokens == 40
    # every request that started on w0 (one, or both if w0's failure cooldown ended in between) was
    # resumed on w1 from prompt + the 3 streamed ids, with the 37 tokens still to go
    started_on_w0 = len(pool[0].worker.submitted)
    assert started_on_w0 >= 1 and router.stats()["requests"]["resumed"] == resumed_before + started_on_w0
    resumed = [r for r in pool[1].worker.submitted if r.sampling.max_tokens != 40]
    assert len(resumed) == started_on_w0
    assert all(r.sampling.max_tokens == 37 and len(r.prompt_token_ids) == len(tok.encode("x")) + 3 for r in resumed)
    for s in pool:
        s.worker.reset()
    wait_until(lambda: _all_healthy(router), what="cooldown over")


def test_worker_death_mid_stream_without_resumption_is_unavailable_and_avoided(smollm2_path, tok, pool):
    with serve_router(_config(smollm2_path, resume_on_worker_failure=False), members(pool), tokenizer=tok) as r, \
            grpc.insecure_channel(r.address) as channel:
        _worker_death_unavailable_and_avoided(r, duet_pb2_grpc.DuetStub(channel), pool)


def test_resumption_gives_up_when_no_worker_is_left(smollm2_path, tok, pool):
    # a long cooldown keeps each failed worker out (their servers stay up: "abort" fails only the stream)
    with serve_router(_config(smollm2_path, worker_wait_s=0.3, stream_failure_cooldown_s=30.0), members(pool),
                      tokenizer=tok) as r, \
            grpc.insecure_channel(r.address) as channel:
        for s in pool:  # every worker dies after 3 tokens: resume once, then nobody is left
            s.worker.die_after, s.worker.die_mode, s.worker.delay_s = 3, "abort", 0.005
        t0 = time.monotonic()
        err = _error(duet_pb2_grpc.DuetStub(channel), duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=40)))
        assert time.monotonic() - t0 < 3
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "no healthy worker to resume on" in err.details()
        assert "after 6 generated tokens" in err.details() and r.stats()["requests"]["failed_mid_stream"] == 1
        for s in pool:
            s.worker.reset()


def _worker_death_unavailable_and_avoided(router, stub, pool):
    for s in pool:  # whichever worker gets the request dies (its whole server stops) after 3 tokens
        s.worker.die_after, s.worker.die_mode, s.worker.delay_s = 3, "stop", 0.01
    t0 = time.monotonic()
    err = _error(stub, duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=40)))
    assert time.monotonic() - t0 < 3  # never hangs
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "mid-stream" in err.details()
    dead = next(s for s in pool if s.worker.submitted)
    alive = next(s for s in pool if s is not dead)
    assert not dead.running
    for s in pool:
        s.worker.reset()
    for _ in range(4):
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=2)), timeout=10))
    assert len(alive.worker.submitted) == 4 and not dead.worker.submitted
    # The worker comes back (same endpoint): once a poll succeeds it takes traffic again.
    dead.start()
    wait_until(lambda: _all_healthy(router), what="restarted worker healthy again")
    for _ in range(4):
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=2)), timeout=10))
    assert len(dead.worker.submitted) >= 1


def test_worker_abort_mid_stream_without_resumption_is_unavailable(smollm2_path, tok, pool):
    with serve_router(_config(smollm2_path, resume_on_worker_failure=False), members(pool), tokenizer=tok) as r, \
            grpc.insecure_channel(r.address) as channel:
        for s in pool:
            s.worker.die_after, s.worker.die_mode = 2, "abort"
        err = _error(duet_pb2_grpc.DuetStub(channel), duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=40)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "mid-stream" in err.details()
        assert "retry the request" in err.details() and r.stats()["worker_stream_failures"] >= 1
        for s in pool:
            s.worker.reset()


def test_failure_before_first_token_is_retried_on_another_worker(stub, pool, router):
    pool[0].worker.die_after, pool[0].worker.die_mode = 0, "abort"
    pool[1].worker.die_after, pool[1].worker.die_mode = 0, "abort"
    # Both fail before any token: UNAVAILABLE after trying both.
    err = _error(stub, duet_pb2.GenerateRequest(prompt="x"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "tried 2 worker(s)" in err.details()
    for s in pool:
        s.worker.reset()
    wait_until(lambda: _all_healthy(router), what="cooldown over")
    pool[0].worker.die_after = 0  # only w0 fails: the client never notices
    for _ in range(2):
        responses = list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=3)), timeout=10))
        assert responses[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH


def test_unresponsive_worker_is_given_up_and_the_stream_resumes_elsewhere(router, pool):
    for s in pool:
        s.worker.delay_s = 0.01
    resumed_before = router.stats()["requests"].get("resumed", 0)

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = duet_pb2_grpc.DuetStub(channel).Generate(
                duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=45)), timeout=20)
            first = await call.read()
            hung = next(s for s in pool if s.worker.submitted)
            hung.worker.hang = True  # polls and stream stall
            t0 = time.monotonic()
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            return [first, *rest], time.monotonic() - t0, hung
    out, elapsed, hung = run_async(scenario())
    # 2 polls (threshold) x 0.5 s timeout: the router gives up on the worker, then resumes the stream
    # on the other one: the client gets every token, in order, with no error.
    assert elapsed < 4 and out[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in out) == 45 and out[-1].usage.completion_tokens == 45
    assert router.stats()["requests"]["resumed"] == resumed_before + 1
    hung.worker.hang = False
    for s in pool:
        s.worker.reset()
    wait_until(lambda: _all_healthy(router), timeout=10, what="the hung worker healthy again")


def test_draining_worker_gets_no_traffic(stub, pool, router):
    pool[0].set_serving(False)
    wait_until(lambda: not router.stats()["workers"][0]["healthy"], what="w0 NOT_SERVING seen")
    for _ in range(4):
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=2)), timeout=10))
    assert _submitted(pool) == Counter({"w0": 0, "w1": 4})


# ------------------------------------------------------------------ membership and health
def _health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_set_members_join_leave_and_health(router, stub, pool):
    assert _health(router.address) == "SERVING"
    assert _health(router.address, "duet.v1.Duet") == "SERVING"
    router.set_members(members(pool[:1]))  # w1 leaves
    for _ in range(3):
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=2)), timeout=10))
    assert _submitted(pool) == Counter({"w0": 3, "w1": 0})
    router.set_members([])  # everyone leaves
    wait_until(lambda: _health(router.address) == "NOT_SERVING", what="NOT_SERVING")
    err = _error(stub, duet_pb2.GenerateRequest(prompt="x"), timeout=1.5)  # waits for a worker to join, then:
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no workers registered" in err.details()
    router.set_members(members(pool))  # both (re)join; set_members returns after their first poll
    assert _health(router.address) == "SERVING"
    for _ in range(4):
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=2)), timeout=10))
    assert _submitted(pool)["w1"] >= 1


def test_health_flips_when_all_workers_die_and_requests_wait_for_one(router, stub, pool):
    for s in pool:
        s.stop_sync()
    wait_until(lambda: _health(router.address) == "NOT_SERVING", what="NOT_SERVING")
    # within its deadline a request waits for a worker; past it (minus a margin) it gets UNAVAILABLE
    t0 = time.monotonic()
    err = _error(stub, duet_pb2.GenerateRequest(prompt="x"), timeout=1.0)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no healthy worker" in err.details()
    assert 0.6 < time.monotonic() - t0 < 1.0
    waited_before = router.stats()["requests"].get("waited_for_worker", 0)

    async def wait_through_the_outage():
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = duet_pb2_grpc.DuetStub(channel).Generate(
                duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=3)), timeout=20)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(pool[1].start)  # a worker comes back while the request waits
            return [m async for m in call]
    out = run_async(wait_through_the_outage())
    assert out[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH
    assert router.stats()["requests"]["waited_for_worker"] == waited_before + 1
    wait_until(lambda: _health(router.address) == "SERVING", what="SERVING again")


def test_leaving_worker_finishes_its_streams(router, pool):
    for s in pool:
        s.worker.delay_s = 0.02

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = duet_pb2_grpc.DuetStub(channel).Generate(
                duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=30)), timeout=20)
            first = await call.read()
            busy = next(s for s in pool if s.worker.submitted)
            await asyncio.to_thread(router.set_members, members([s for s in pool if s is not busy]))
            responses = [first]
            while (r := await call.read()) is not grpc.aio.EOF:
                responses.append(r)
            return responses
    responses = run_async(scenario())
    assert responses[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 30


def test_draining_router_hands_off_a_stream_awaiting_its_next_token(smollm2_path, tok, pool):
    """A stream whose worker is slow to send its next token (a long prefill, a busy worker) is handed
    off at half the grace, not when that token finally comes nor cancelled when the grace ends."""
    from router.server import HANDOFF_METADATA_KEY

    for s in pool:
        s.worker.delay_s = 30.0  # the first message at once, the next one after 30 s
    r = serve_router(_config(smollm2_path), members(pool), tokenizer=tok)
    try:
        async def scenario():
            async with grpc.aio.insecure_channel(r.address) as channel:
                call = duet_pb2_grpc.DuetStub(channel).Generate(
                    duet_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=20)), timeout=60)
                first = await call.read()
                started = time.monotonic()
                stopping = asyncio.ensure_future(asyncio.to_thread(r.stop, 6.0))  # hands off at 3 s
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                ended = time.monotonic() - started
                await stopping
                return first, e.value, ended
        first, err, ended = run_async(scenario(), timeout=60)
        assert len(first.token_ids) >= 1
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
        assert (HANDOFF_METADATA_KEY, "1") in tuple(err.trailing_metadata() or ())
        assert 2.5 < ended < 5.5, ended  # at half the grace, before the grace ends
        assert r.server.servicer.num_handed_off == 1
        worker = next(s.worker for s in pool if s.worker.submitted)
        assert worker.cancelled_event.wait(30)  # the worker call was cancelled: its request aborted
    finally:
        r.stop(0)


# ------------------------------------------------------------------ ListModels, reflection, config
def test_list_models(stub, router):
    r = stub.ListModels(duet_pb2.ListModelsRequest(), timeout=5)
    assert [(m.name, m.is_default, m.max_model_len) for m in r.models] == [
        ("SmolLM2-135M-Instruct", True, MAX_MODEL_LEN)]


def test_reflection_lists_services(router):
    with grpc.insecure_channel(router.address) as channel:
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"duet.v1.Duet", "grpc.health.v1.Health"} <= names


def test_max_model_len_read_from_checkpoint(smollm2_path, tok):
    with serve_router(_config(smollm2_path, max_model_len=None), [], tokenizer=tok) as r:
        assert r.server.pipeline.model.max_model_len == 8192
        assert _health(r.address) == "NOT_SERVING"  # no workers yet: not ready ...
        assert _health(r.address, "duet.control.v1.RouterAdmin") == "SERVING"  # ... but alive (liveness probe)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"port": 70000}, "port"), ({"policy": "fastest"}, "policy"), ({"max_in_flight": 0}, "max_in_flight"),
    ({"default_top_p": 0.0}, "default_top_p"), ({"load_poll_interval_s": 0}, "load_poll_interval_s"),
    ({"policy": "prefix_aware", "policy_options": {"block_size": 0}}, "policy"),
    ({"max_model_len": 1}, "max_model_len"), ({"tokenizer_path": ""}, "tokenizer_path"),
])
def test_config_errors_name_the_field(smollm2_path, overrides, field):
    with pytest.raises(RouterConfigError, match=f"^{field}"):
        _config(smollm2_path, **overrides)


def test_busy_port_is_a_clear_error(smollm2_path, tok, router):
    with pytest.raises(RouterConfigError, match="port"):
        serve_router(_config(smollm2_path, port=router.port), [], tokenizer=tok)
