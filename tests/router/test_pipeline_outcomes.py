"""The router's attempt loop (router/pipeline.py) driven with fakes, without the gRPC server
(the ``fake_pipeline`` fixture, tests/router/conftest.py: an in-memory worker directory whose
Submit calls replay a script like a greedy model and fail on cue). Retry before the first token, resume after it (the
output identical to an uninterrupted run), give up after N, the disaggregated prefill retry,
pass-through errors, the deadline, waiting for a worker, and cancellation; every test also
checks that no worker lease, admission slot or worker call is left behind."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.duet.v1 import duet_pb2
from router.pipeline import Pipeline
from router.preprocess import RequestError

Code = grpc.StatusCode
PROMPT = [9, 8, 7]


def request(max_tokens: int = 12, **sampling) -> duet_pb2.GenerateRequest:
    return duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=PROMPT),
                                    sampling=duet_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **sampling))


async def collect(pipeline: Pipeline, req: duet_pb2.GenerateRequest, deadline: float | None = None,
                  into: list | None = None) -> list[duet_pb2.GenerateResponse]:
    out = [] if into is None else into
    async for response in pipeline.generate(req, deadline=deadline):
        out.append(response)
    return out


def text_and_ids(responses: list[duet_pb2.GenerateResponse]) -> tuple[str, list[int]]:
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


def baseline(fake_pipeline, max_tokens: int = 12) -> tuple[str, list[int]]:
    pipeline, _ = fake_pipeline()
    return text_and_ids(asyncio.run(collect(pipeline, request(max_tokens))))


def test_an_uninterrupted_stream_finishes_with_usage(fake_pipeline):
    pipeline, directory = fake_pipeline()
    out = asyncio.run(collect(pipeline, request(12)))
    _, ids = text_and_ids(out)
    assert ids == directory.workers["w0"].script[:12]
    assert out[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH
    assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens) == (len(PROMPT), 12)
    assert all(not r.HasField("finish_reason") for r in out[:-1])
    assert pipeline.counts["finish_length"] == 1 and not directory.reported


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.CANCELLED])
def test_a_failure_before_the_first_token_is_retried_on_another_worker(fake_pipeline, code):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(fail=(code, "socket closed"))
    assert text_and_ids(asyncio.run(collect(pipeline, request(12)))) == expected
    assert directory.reported == [("w0", f"{code.name}: socket closed")]
    assert directory.workers["w1"].submitted[0].prompt_token_ids == PROMPT  # from the start
    assert pipeline.counts["retried"] == 1 and pipeline.counts["resumed"] == 0


def test_a_full_queue_is_retried_without_blaming_the_worker(fake_pipeline):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(fail=(Code.RESOURCE_EXHAUSTED, "queue full"))
    assert text_and_ids(asyncio.run(collect(pipeline, request(12)))) == expected
    assert pipeline.counts["retried"] == 1 and not directory.reported


@pytest.mark.parametrize("cue", [{"fail": (Code.UNAVAILABLE, "gone"), "fail_after": 5}, {"end_after": 5},
                                 {"declare_dead": (5, "w0")}], ids=["unavailable", "no-finish-reason", "declared-dead"])
def test_a_failure_after_tokens_resumes_on_another_worker_with_identical_output(fake_pipeline, cue):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(**cue)
    assert text_and_ids(asyncio.run(collect(pipeline, request(12)))) == expected
    resumed = directory.workers["w1"].submitted[0]
    assert list(resumed.prompt_token_ids) == PROMPT + expected[1][:5] and resumed.sampling.max_tokens == 7
    assert pipeline.counts["resumed"] == 1 and pipeline.counts["retried"] == 0
    assert [wid for wid, _ in directory.reported] == ["w0"]


def test_giving_up_after_max_route_attempts_names_the_workers_tried(fake_pipeline):
    pipeline, directory = fake_pipeline(max_route_attempts=2)
    for w in directory.workers.values():
        w.misbehave(fail=(Code.UNAVAILABLE, "down"))
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request()))
    assert info.value.code is Code.UNAVAILABLE
    assert info.value.message == "worker w1 is unavailable (UNAVAILABLE: down) (tried 2 worker(s): w0, w1)"
    assert not directory.workers["w2"].submitted
    assert pipeline.counts["retried"] == 1 and pipeline.counts["error_unavailable"] == 1


def test_resumes_run_out_after_max_resumes(fake_pipeline):
    pipeline, directory = fake_pipeline(max_resumes=1)
    for w in directory.workers.values():
        w.misbehave(fail=(Code.UNAVAILABLE, "gone"), fail_after=2)
    got: list[duet_pb2.GenerateResponse] = []
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request(), into=got))
    assert info.value.code is Code.UNAVAILABLE
    assert info.value.message == ("worker w1 failed mid-stream after 4 generated tokens (UNAVAILABLE: gone); the "
                                  "completion is incomplete, retry the request")
    assert len(text_and_ids(got)[1]) == 4 and not directory.workers["w2"].submitted
    assert pipeline.counts["resumed"] == 1 and pipeline.counts["failed_mid_stream"] == 1


def test_without_resumption_a_mid_stream_failure_ends_the_stream(fake_pipeline):
    pipeline, directory = fake_pipeline(resume_on_worker_failure=False)
    directory.workers["w0"].misbehave(end_after=3)
    with pytest.raises(RequestError, match="failed mid-stream after 3 generated tokens"):
        asyncio.run(collect(pipeline, request()))
    assert not directory.workers["w1"].submitted and pipeline.counts["failed_mid_stream"] == 1


def test_no_worker_to_resume_on_is_unavailable(fake_pipeline):
    pipeline, directory = fake_pipeline(roles={"w0": "colocated"}, worker_wait_s=0.1)
    directory.workers["w0"].misbehave(fail=(Code.UNAVAILABLE, "gone"), fail_after=2)
    with pytest.raises(RequestError, match="no healthy worker to resume on within 0.1 s after 2 generated tokens"):
        asyncio.run(collect(pipeline, request()))
    assert pipeline.counts["failed_mid_stream"] == 1


@pytest.mark.parametrize("code", [Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.FAILED_PRECONDITION])
def test_bad_input_errors_pass_through_without_a_retry(fake_pipeline, code):
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(fail=(code, "sampling.top_k: too large"))
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request()))
    assert (info.value.code, info.value.message) == (code, "sampling.top_k: too large")
    assert not directory.workers["w1"].submitted and not directory.reported


def test_an_unknown_worker_error_passes_through_with_the_worker_id(fake_pipeline):
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(fail=(Code.INTERNAL, "kernel crashed"), fail_after=2)
    got: list[duet_pb2.GenerateResponse] = []
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request(), into=got))
    assert (info.value.code, info.value.message) == (Code.INTERNAL, "worker w0: kernel crashed")
    assert len(text_and_ids(got)[1]) == 2 and not directory.workers["w1"].submitted


def test_the_deadline_bounds_the_worker_call_and_passes_through(fake_pipeline):
    pipeline, directory = fake_pipeline()
    asyncio.run(collect(pipeline, request(), deadline=time.monotonic() + 5.0))
    assert 4.0 < directory.workers["w0"].timeouts[0] <= 5.0
    directory.workers["w1"].misbehave(fail=(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"), fail_after=3)
    directory.unhealthy.add("w0")  # route to w1
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request(), deadline=time.monotonic() + 5.0))
    assert (info.value.code, info.value.message) == (Code.DEADLINE_EXCEEDED, "deadline exceeded after 3 generated tokens")
    assert len(directory.workers["w1"].submitted) == 1 and not directory.workers["w2"].submitted


def test_waiting_for_a_worker_stops_before_the_deadline(fake_pipeline):
    pipeline, directory = fake_pipeline(worker_wait_s=10.0)
    directory.unhealthy.update(directory.workers)
    started = time.monotonic()
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request(), deadline=started + 0.6))
    took = time.monotonic() - started
    assert info.value.code is Code.UNAVAILABLE and "no healthy worker to serve the request" in info.value.message
    assert 0.3 <= took < 0.6  # gives up a margin before the deadline, not after worker_wait_s


def test_a_request_waits_for_a_worker_to_come_back(fake_pipeline):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline(worker_wait_s=5.0)
    directory.unhealthy.update(directory.workers)

    async def heal_later() -> list[duet_pb2.GenerateResponse]:
        asyncio.get_running_loop().call_later(0.2, directory.unhealthy.discard, "w1")
        return await collect(pipeline, request())

    assert text_and_ids(asyncio.run(heal_later())) == expected
    assert pipeline.counts["waited_for_worker"] == 1 and len(directory.workers["w1"].submitted) == 1


def test_a_worker_restarted_after_failing_a_request_serves_it(fake_pipeline):
    """The only decode worker fails the request before its first token (a prefill worker is left,
    so the request waits), then Ray restarts it: the held request runs on the new process as soon as
    it is back (the failed process is excluded, not the worker id), not after worker_wait_s."""
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline(roles={"d0": "decode", "p0": "prefill"}, worker_wait_s=30.0)
    directory.workers["d0"].misbehave(fail=(Code.UNAVAILABLE, "socket closed"))

    async def restart_later() -> list[duet_pb2.GenerateResponse]:
        asyncio.get_running_loop().call_later(0.2, directory.restart, "d0")
        return await collect(pipeline, request())

    started = time.monotonic()
    assert text_and_ids(asyncio.run(restart_later())) == expected
    assert time.monotonic() - started < 10  # not worker_wait_s (30 s)
    assert len(directory.workers["d0"].submitted) == 2 and pipeline.counts["retried"] == 1
    assert pipeline.counts["waited_for_worker"] == 1


DISAGG = {"d0": "decode", "p0": "prefill", "p1": "prefill"}


def test_a_disaggregated_route_names_its_prefill_worker(fake_pipeline):
    pipeline, directory = fake_pipeline(roles=DISAGG)
    asyncio.run(collect(pipeline, request()))
    rp = directory.workers["d0"].submitted[0].remote_prefill
    assert (rp.worker_id, rp.endpoint, rp.incarnation) == ("p0", "p0:1", "inc-p0")


def _prefill_ids(worker) -> list[str | None]:
    return [r.remote_prefill.worker_id if r.HasField("remote_prefill") else None for r in worker.submitted]


def test_a_failed_prefill_half_is_retried_once_colocated_on_the_decode_worker(fake_pipeline):
    # Not on "another" prefill worker: p1 looks healthy but may have gone with p0's node (the
    # router learns that only when its polls fail); the decode worker computes the prompt itself.
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline(roles=DISAGG)
    d0 = directory.workers["d0"]
    d0.misbehave(bad_prefill={"p0", "p1"})
    assert text_and_ids(asyncio.run(collect(pipeline, request()))) == expected
    assert _prefill_ids(d0) == ["p0", None]
    assert directory.reported == [("p0", "remote prefill failed: p0")]  # the decode worker is not blamed
    assert pipeline.counts["prefill_failures"] == 1 and pipeline.counts["retried"] == 1
    assert pipeline.router.counters()["retry_colocated"] == 1  # counted (and logged), never silent


def test_a_retry_after_a_prefill_failure_runs_colocated_without_a_prefill_worker(fake_pipeline):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline(roles={"d0": "decode", "p0": "prefill"})
    directory.workers["d0"].misbehave(bad_prefill={"p0"})
    assert text_and_ids(asyncio.run(collect(pipeline, request()))) == expected
    assert _prefill_ids(directory.workers["d0"]) == ["p0", None]


def test_a_prefill_worker_declared_dead_before_the_first_token_is_retried(fake_pipeline):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline(roles=DISAGG)
    directory.workers["d0"].misbehave(vanished_prefill={"p0"})
    assert text_and_ids(asyncio.run(collect(pipeline, request()))) == expected
    d0 = directory.workers["d0"]
    assert _prefill_ids(d0) == ["p0", None]
    assert d0.cancelled == [d0.submitted[0].request_id]  # the stalled call was cancelled
    assert pipeline.counts["prefill_failures"] == 1 and not directory.reported  # already declared dead


def test_a_prefill_worker_dying_after_the_first_token_does_not_cut_the_stream(fake_pipeline):
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline(roles=DISAGG)
    directory.workers["d0"].misbehave(declare_dead=(3, "p0"))  # its part (the prompt's KV) is done
    assert text_and_ids(asyncio.run(collect(pipeline, request()))) == expected
    assert len(directory.workers["d0"].submitted) == 1 and pipeline.counts["resumed"] == 0


def test_closing_the_stream_cancels_the_worker_call(fake_pipeline):
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(hang_after=3)

    async def read_two_then_close() -> None:
        stream = pipeline.generate(request())
        assert len([await anext(stream) for _ in range(2)]) == 2
        await stream.aclose()  # what a front door does when its client goes away
        # at once, not when the event loop finalizes the abandoned generators
        w0 = directory.workers["w0"]
        assert w0.cancelled == [w0.submitted[0].request_id] and pipeline.counts["cancelled"] == 1
        assert not directory.leases and pipeline.admission.stats()["in_flight"] == 0

    asyncio.run(read_two_then_close())


def test_cancelling_the_request_task_cancels_the_worker_call(fake_pipeline):
    pipeline, directory = fake_pipeline()
    w0 = directory.workers["w0"]
    w0.misbehave(hang_after=3)

    async def cancel_while_waiting() -> None:
        task = asyncio.ensure_future(collect(pipeline, request()))
        while not w0.submitted:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_waiting())
    assert w0.cancelled == [w0.submitted[0].request_id] and pipeline.counts["cancelled"] == 1
    assert not directory.reported and pipeline.counts["retried"] == pipeline.counts["resumed"] == 0


def test_a_live_migration_continues_on_the_target_from_the_exact_token(fake_pipeline):
    """The worker's stream ends with migrated_to: the next attempt attaches to the target with the
    migration id, prompt + streamed tokens and the rest of max_tokens; no budget is spent, nobody
    is reported, the output is the uninterrupted one."""
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(migrate_after=(4, "w2", None))
    assert text_and_ids(asyncio.run(collect(pipeline, request(12)))) == expected
    attach = directory.workers["w2"].submitted[0]
    assert attach.migration_id.startswith("mig/") and attach.resumed_output_tokens == 4
    assert list(attach.prompt_token_ids) == PROMPT + expected[1][:4] and attach.sampling.max_tokens == 8
    assert pipeline.counts["migrated"] == 1 and pipeline.counts["resumed"] == 0 and not directory.reported
    assert not directory.workers["w1"].submitted


@pytest.mark.parametrize("target, reported", [("w9", None), ("w2", 3)])
def test_a_migration_that_cannot_be_attached_resumes_by_recompute(fake_pipeline, target, reported):
    """Target unknown to the directory, or its token count disagrees with what was streamed: the
    next attempt is a plain resume (no migration id): never a gap or a repeat."""
    expected = baseline(fake_pipeline)
    pipeline, directory = fake_pipeline()
    directory.workers["w0"].misbehave(migrate_after=(4, target, reported))
    assert text_and_ids(asyncio.run(collect(pipeline, request(12)))) == expected
    later = [r for w in directory.workers.values() for r in w.submitted if r.resumed_output_tokens]
    assert later and all(r.migration_id == "" for r in later)
    assert sorted(r.resumed_output_tokens for r in later)[0] == 4
    assert pipeline.counts["migrated"] >= 1 and not directory.reported
