"""router/client.py against a real router in front of fake workers: the async DuetClient and the
sync helpers stream, collect, cancel, and raise DuetError with the server's status and message."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from testkit.router_fakes import SCRIPT, members, run_async

from protos.duet.v1 import duet_pb2
from router.client import Chunk, Completion, DuetClient, DuetError, ModelInfo, build_request, collect, \
    collect_choices, complete, generate_text, stream
from router.config import RouterConfig
from router.server import serve_router


@pytest.fixture(scope="module")
def target(smollm2_path, tok, pool):
    config = RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, max_model_len=512, policy="round_robin",
                          load_poll_interval_s=0.05)
    with serve_router(config, members(pool), tokenizer=tok) as handle:
        yield handle.address


@pytest.fixture(autouse=True)
def reset(pool):
    for s in pool:
        s.worker.reset()


def test_async_generate_streams_chunks(target, tok):
    async def main() -> list[Chunk]:
        async with DuetClient(target) as client:
            return [c async for c in client.generate("Hello", max_tokens=100, temperature=0, request_id="r1")]
    chunks = run_async(main())
    assert len(chunks) > 1 and all(c.request_id == "r1" for c in chunks)
    assert "".join(c.text for c in chunks) == SCRIPT
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks)


def test_async_complete_messages_list_models_and_health(target, pool):
    async def main():
        async with DuetClient(target) as client:
            done = await client.complete(messages=[{"role": "user", "content": "hi"}], max_tokens=5, stop="never")
            return done, await client.list_models(), await client.health()
    done, models, health = run_async(main())
    assert isinstance(done, Completion) and done.finish_reason == "length" and len(done.token_ids) == 5
    assert done.usage.prompt_tokens > 5  # the chat template wrapped the message
    (sent,) = [r for s in pool for r in s.worker.submitted]
    assert list(sent.sampling.stop) == ["never"]
    assert models == [ModelInfo("SmolLM2-135M-Instruct", True, 512)]
    assert health == "SERVING"


def test_async_break_cancels_the_request(target, pool):
    for s in pool:
        s.worker.delay_s = 0.05

    async def main():
        async with DuetClient(target) as client:
            async with contextlib.aclosing(client.generate("x", max_tokens=45)) as chunks:
                async for chunk in chunks:  # noqa: B007 - the first chunk is returned below
                    break  # aclosing: the call is cancelled here, not whenever the generator is collected
            return chunk
    first = run_async(main())
    assert first.token_ids
    worker = next(s.worker for s in pool if s.worker.submitted)
    assert worker.cancelled_event.wait(30)  # an event: a pass returns at once; 30 s for an overloaded host


def test_async_errors_are_duet_errors(target, pool):
    for s in pool:
        s.worker.delay_s = 0.05

    async def main():
        errors = []
        async with DuetClient(target) as client:
            for kwargs in ({"top_p": 2.0}, {"model": "nope"}, {"max_tokens": 45, "timeout": 0.3}):
                with pytest.raises(DuetError) as info:
                    await client.complete("x", **kwargs)
                errors.append(info.value)
        return errors
    bad_top_p, unknown_model, deadline = run_async(main())
    assert bad_top_p.code == grpc.StatusCode.INVALID_ARGUMENT and bad_top_p.details.startswith("sampling.top_p")
    assert unknown_model.code == grpc.StatusCode.NOT_FOUND
    assert deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(bad_top_p).startswith("INVALID_ARGUMENT: sampling.top_p")


def test_sync_helpers(target, tok):
    assert generate_text("Hello", target=target, max_tokens=100) == SCRIPT
    ids = tok.encode("Hello")
    done = complete(token_ids=ids, target=target, max_tokens=3, seed=1)
    assert done.usage.prompt_tokens == len(ids) and done.finish_reason == "length" and len(done.token_ids) == 3
    with pytest.raises(DuetError) as info:
        generate_text("", target=target)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.details.startswith("prompt")


def test_sync_stream_closed_early_cancels(target, pool):
    for s in pool:
        s.worker.delay_s = 0.05
    it = stream("x", target=target, max_tokens=45)
    assert next(it).token_ids
    it.close()
    worker = next(s.worker for s in pool if s.worker.submitted)
    assert worker.cancelled_event.wait(30)  # an event: a pass returns at once; 30 s for an overloaded host


def test_build_request():
    r = build_request(messages=[("system", "s"), {"role": "user", "content": "u"}], stop="\n\n", max_tokens=8)
    assert r.WhichOneof("input") == "messages" and [m.role for m in r.messages.messages] == ["system", "user"]
    assert list(r.sampling.stop) == ["\n\n"] and r.sampling.max_tokens == 8
    assert not r.sampling.HasField("temperature")  # unset -> the server default
    assert build_request(messages=[]).WhichOneof("input") == "messages"  # the server rejects it by name
    assert build_request(token_ids=[1, 2]).prompt_token_ids.ids == [1, 2]
    assert build_request("p", temperature=0.0).sampling.HasField("temperature")
    for bad in ({}, {"prompt": "a", "token_ids": [1]}):
        with pytest.raises(ValueError, match="exactly one"):
            build_request(**bad)
    assert Chunk.from_proto(duet_pb2.GenerateResponse(request_id="r", text="t")).finish_reason is None


def test_retries_resource_exhausted_before_the_first_token(smollm2_path, tok, pool):
    """Admission full (max_in_flight=1, no queue): a second request is rejected with
    RESOURCE_EXHAUSTED; with retries (the default) gRPC retries it with backoff until the first
    request is done and it is admitted; with retries=0 the caller sees the rejection."""
    pool[0].worker.delay_s = 0.01  # the first request streams for ~0.2 s (the retries back off up to 3 s)
    config = RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, max_model_len=512,
                          policy="round_robin", load_poll_interval_s=0.05, max_in_flight=1, max_queue=0)
    with serve_router(config, members(pool[:1]), tokenizer=tok) as handle:
        async def main() -> tuple[str, grpc.StatusCode, str]:
            async with DuetClient(handle.address, retries=0) as plain, DuetClient(handle.address, retries=4) as patient:
                first = asyncio.ensure_future(plain.complete("Hi", max_tokens=20, temperature=0))
                while handle.server.pipeline.admission.in_flight == 0:
                    await asyncio.sleep(0.005)
                with pytest.raises(DuetError) as rejected:
                    await plain.complete("Hi", max_tokens=2)
                retried = await patient.complete("Hi", max_tokens=2, temperature=0)  # waits out the first one
                await first
                return retried.text, rejected.value.code, retried.finish_reason
        text, code, finish = run_async(main())
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert text and finish == "length"
        assert handle.stats()["admission"]["rejected"] >= 2  # the rejected call and >= 1 retried attempt


def test_retry_options_validated():
    from router.client import retry_options

    with pytest.raises(ValueError, match="retries=5"):
        DuetClient("localhost:1", retries=5)
    assert retry_options(0) == [("grpc.enable_retries", 0)]


def test_sampling_fields_n_choices_and_logprobs(target, tok):
    r = build_request("p", presence_penalty=0.5, repetition_penalty=1.1, min_p=0.05, min_tokens=2,
                      logit_bias={7: -1.5}, top_logprobs=3, n=2)
    p = r.sampling
    assert (p.presence_penalty, p.min_tokens, p.top_logprobs, dict(p.logit_bias), r.n) == (0.5, 2, 3, {7: -1.5}, 2)
    assert not p.HasField("frequency_penalty")  # unset -> the server default (off)
    chunks = list(stream("Hello", target=target, max_tokens=5, n=3, seed=4, top_logprobs=1))
    choices = collect_choices(chunks)
    assert [c.index for c in choices] == [0, 1, 2]
    for c in choices:
        assert len(c.token_ids) == 5 and c.finish_reason == "length" and c.usage.completion_tokens == 5
        assert [lp.token_id for lp in c.logprobs] == list(c.token_ids) and all(len(lp.top) == 1 for lp in c.logprobs)
    with pytest.raises(ValueError, match="collect_choices"):
        collect(chunks)
