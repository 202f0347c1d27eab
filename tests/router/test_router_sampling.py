"""The router's side of the sampling surface, against in-process fake workers
(tests/router/router_fakes.py): penalty / logprob fields resolved and passed to the worker, bad
values rejected with INVALID_ARGUMENT naming the field before any worker sees them, logprobs
streamed one per token id (cut with the ids at a stop string), and ``n`` fanned out into n worker
streams (derived seeds, per-choice index / finish / usage, the rest sent after choice 0's first
message, cancellation of every choice)."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from testkit.router_fakes import fake_logprob, members, wait_until

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig, RouterConfigError
from router.server import serve_router

S = duet_pb2.SamplingParams


@pytest.fixture(scope="module")
def router(smollm2_path, tok, pool):
    config = RouterConfig(tokenizer_path=str(smollm2_path), port=0, max_model_len=512, policy="round_robin",
                          load_poll_interval_s=0.05, load_poll_timeout_s=0.5, max_n=6)
    handle = serve_router(config, members(pool), tokenizer=tok)
    yield handle
    handle.stop(0)


@pytest.fixture(autouse=True)
def clean_pool(pool, router):
    for s in pool:
        s.worker.reset()
        if not s.running:
            s.start()
        s.set_serving(True)
    router.set_members(members(pool))
    wait_until(lambda: all(w["healthy"] for w in router.stats()["workers"]) and len(router.stats()["workers"]) == 2,
               what="both workers healthy")


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield duet_pb2_grpc.DuetStub(channel)


def _sent(pool):
    return [r for s in pool for r in s.worker.submitted]


def test_new_fields_are_resolved_and_passed_to_the_worker(stub, pool):
    list(stub.Generate(duet_pb2.GenerateRequest(prompt="Hi", sampling=S(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.1, min_tokens=3,
        logit_bias={42: -100.0, 7: 2.5}, top_logprobs=4)), timeout=10))
    (sent,) = _sent(pool)
    p = sent.sampling
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens, p.top_logprobs) == (
        0.5, -0.25, pytest.approx(1.2), pytest.approx(0.1), 3, 4)
    assert dict(p.logit_bias) == {42: -100.0, 7: 2.5}


def test_unset_fields_mean_off(stub, pool):
    list(stub.Generate(duet_pb2.GenerateRequest(prompt="Hi"), timeout=10))
    (sent,) = _sent(pool)
    p = sent.sampling
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (0, 0, 1, 0, 0)
    assert not p.logit_bias and not p.HasField("top_logprobs")


BAD = [
    ("presence", S(presence_penalty=2.5), "sampling.presence_penalty"),
    ("frequency_nan", S(frequency_penalty=math.nan), "sampling.frequency_penalty"),
    ("repetition_0", S(repetition_penalty=0.0), "sampling.repetition_penalty"),
    ("repetition_big", S(repetition_penalty=101.0), "sampling.repetition_penalty"),
    ("min_p", S(min_p=1.5), "sampling.min_p"),
    ("min_tokens", S(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
    ("bias_vocab", S(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
    ("bias_value", S(logit_bias={5: 150.0}), "sampling.logit_bias[5]"),
    ("bias_many", S(logit_bias={i: 1.0 for i in range(1025)}), "sampling.logit_bias"),
    ("top_logprobs", S(top_logprobs=21), "sampling.top_logprobs"),
]


@pytest.mark.parametrize(("sampling", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_are_rejected_naming_the_field(stub, pool, sampling, field):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=sampling), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:"), info.value.details()
    assert not _sent(pool)


def test_n_over_the_limit_is_rejected(stub, pool):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", n=7), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("n:")
    assert not _sent(pool)


def test_max_n_is_validated():
    with pytest.raises(RouterConfigError, match="max_n"):
        RouterConfig(tokenizer_path="/x", max_n=0)


def test_logprobs_one_per_token_and_cut_at_a_stop_string(stub, tok):
    req = duet_pb2.GenerateRequest(prompt="Hi", sampling=S(max_tokens=200, top_logprobs=2))
    responses = list(stub.Generate(req, timeout=10))
    ids = [t for r in responses for t in r.token_ids]
    lps = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == ids
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    for i, lp in enumerate(lps):
        want = fake_logprob(ids[i], i, 2)
        assert lp.logprob == pytest.approx(want.logprob) and [t.token_id for t in lp.top_logprobs] == [
            t.token_id for t in want.top_logprobs]
    stopped = list(stub.Generate(duet_pb2.GenerateRequest(prompt="Hi", sampling=S(
        max_tokens=200, top_logprobs=0, stop=["brown"])), timeout=10))
    ids = [t for r in stopped for t in r.token_ids]
    assert [lp.token_id for r in stopped for lp in r.logprobs] == ids and len(ids) < len(lps)
    no_lp = list(stub.Generate(duet_pb2.GenerateRequest(prompt="Hi", sampling=S(max_tokens=5)), timeout=10))
    assert not any(r.logprobs for r in no_lp)


def test_n_choices_with_derived_seeds_index_finish_and_usage(stub, pool, tok):
    req = duet_pb2.GenerateRequest(prompt="Hi", n=4, request_id="multi", sampling=S(max_tokens=6, seed=2**63 - 2))
    responses = list(stub.Generate(req, timeout=10))
    sent = _sent(pool)
    assert sorted(r.sampling.seed for r in sent) == sorted([2**63 - 2, 2**63 - 1, 0, 1])  # seed + i mod 2^63
    by_choice: dict[int, list] = {}
    for r in responses:
        assert r.request_id == "multi"
        by_choice.setdefault(r.index, []).append(r)
    assert sorted(by_choice) == [0, 1, 2, 3]
    for msgs in by_choice.values():
        assert [m.HasField("finish_reason") for m in msgs] == [False] * (len(msgs) - 1) + [True]
        assert msgs[-1].usage.completion_tokens == 6 == sum(len(m.token_ids) for m in msgs)
        assert msgs[-1].usage.prompt_tokens == len(tok.encode("Hi"))


def test_first_choice_is_sent_alone_until_it_streams(stub, pool):
    for s in pool:
        s.worker.delay_s = 0.3  # the first message comes at once, the next after 0.3 s
        s.worker.hang = True  # nothing streams yet
    req = duet_pb2.GenerateRequest(prompt="Hi", n=3, sampling=S(max_tokens=2))
    stream = stub.Generate(req, timeout=10)
    try:
        wait_until(lambda: len(_sent(pool)) >= 1, what="choice 0 sent")
        time.sleep(0.3)
        assert len(_sent(pool)) == 1  # the others wait for choice 0's prompt to be computed
        for s in pool:
            s.worker.hang = False
        assert {r.index for r in stream} == {0, 1, 2}
        assert len(_sent(pool)) == 3
    finally:
        stream.cancel()


def test_cancelling_an_n_request_cancels_every_choice(stub, pool):
    for s in pool:
        s.worker.delay_s = 0.2
    req = duet_pb2.GenerateRequest(prompt="Hi", n=3, sampling=S(max_tokens=100))
    stream = stub.Generate(req, timeout=10)
    seen = set()
    for r in stream:
        seen.add(r.index)
        if len(seen) == 3:
            break
    stream.cancel()
    # this request's three calls (the previous test's cancelled calls may still be landing)
    mine = {r.request_id for s in pool for r in s.worker.submitted}
    assert len(mine) == 3
    wait_until(lambda: mine <= {rid for s in pool for rid in s.worker.cancelled}, what="all three worker calls cancelled")


def test_resume_counts_the_streamed_tokens_as_generated(stub, pool, tok):
    """A worker dying mid-stream: the request resumes elsewhere with prompt + streamed ids; those ids
    still count for the penalties (resumed_output_tokens) and toward min_tokens."""
    for s in pool:
        s.worker.die_after = 3
    req = duet_pb2.GenerateRequest(prompt="Hi", sampling=S(max_tokens=8, min_tokens=5, frequency_penalty=1.0))
    try:
        list(stub.Generate(req, timeout=10))
    except grpc.RpcError:
        pass  # the second worker dies too; only what it was sent matters here
    subs = sorted(_sent(pool), key=lambda r: r.resumed_output_tokens)  # in the order they were sent
    assert len(subs) >= 2, "no resume happened"
    first, second = subs[:2]
    prompt = tok.encode("Hi")
    assert first.resumed_output_tokens == 0 and list(first.prompt_token_ids) == prompt
    assert len(second.prompt_token_ids) == len(prompt) + 3 and second.resumed_output_tokens == 3
    assert (second.sampling.max_tokens, second.sampling.min_tokens, second.sampling.frequency_penalty) == (5, 2, 1.0)
