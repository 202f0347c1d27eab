"""The attempt outcome values and the one decision function (router/attempt.py), without any
server, worker or event loop: the error mapping, retry before the first token, resume after it,
giving up after N, the disaggregated prefill retry, and the no-worker answers."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from router.attempt import Action, AttemptBudget, AttemptOutcome, OutcomeKind, outcome_from_status, worker_process
from router.config import RouterConfig
from router.policies.base import WorkerState

Code = grpc.StatusCode


def budget(max_route_attempts: int = 2, max_resumes: int = 2, resume: bool = True) -> AttemptBudget:
    return AttemptBudget(max_route_attempts, max_resumes, resume, worker_wait_s=10.0)


@pytest.mark.parametrize("code", [Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.FAILED_PRECONDITION])
@pytest.mark.parametrize("streamed", [0, 5])
def test_bad_input_passes_through_unchanged(code, streamed):
    out = outcome_from_status(code, "sampling.top_k: must be >= 0", "w0", streamed=streamed)
    assert out == AttemptOutcome.fail(code, "sampling.top_k: must be >= 0")
    assert not out.report


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.CANCELLED])
def test_a_dead_worker_is_retried_before_the_first_token_and_resumed_after(code):
    before = outcome_from_status(code, "socket closed", "w0", streamed=0)
    assert before.kind is OutcomeKind.RETRY and before.code is Code.UNAVAILABLE and before.report
    assert before.worker_id == "w0" and f"worker w0 is unavailable ({code.name}: socket closed)" == before.message
    after = outcome_from_status(code, "socket closed", "w0", streamed=3)
    assert after.kind is OutcomeKind.RESUME and after.report and after.reason == f"{code.name}: socket closed"
    assert after.message == f"worker w0 failed mid-stream ({code.name}: socket closed)"


def test_a_full_queue_is_retried_unreported_before_the_first_token_only():
    out = outcome_from_status(Code.RESOURCE_EXHAUSTED, "queue full", "w0")
    assert out == AttemptOutcome.retry(Code.RESOURCE_EXHAUSTED, "worker w0 is overloaded: queue full", "w0")
    assert not out.report  # a busy worker is not a dead one
    late = outcome_from_status(Code.RESOURCE_EXHAUSTED, "queue full", "w0", streamed=2)
    assert late == AttemptOutcome.fail(Code.RESOURCE_EXHAUSTED, "worker w0: queue full")


def test_aborted_blames_the_prefill_half_only_on_a_disaggregated_route_before_the_first_token():
    out = outcome_from_status(Code.ABORTED, "transfer lost", "d0", prefill_id="p0")
    assert out.kind is OutcomeKind.RETRY and out.prefill_failed and out.report
    assert (out.code, out.message, out.worker_id, out.reason) == (Code.UNAVAILABLE, "transfer lost", "p0",
                                                                   "transfer lost")
    assert outcome_from_status(Code.ABORTED, "", "d0", prefill_id="p0").message == "remote prefill failed"
    # colocated, or after tokens: not a prefill failure, passed through with the worker id
    assert outcome_from_status(Code.ABORTED, "x", "d0") == AttemptOutcome.fail(Code.ABORTED, "worker d0: x")
    assert outcome_from_status(Code.ABORTED, "x", "d0", prefill_id="p0", streamed=1).kind is OutcomeKind.FAIL


def test_deadline_and_unknown_errors_fail_at_once():
    assert outcome_from_status(Code.DEADLINE_EXCEEDED, "", "w0", streamed=7) == AttemptOutcome.fail(
        Code.DEADLINE_EXCEEDED, "deadline exceeded after 7 generated tokens")
    assert outcome_from_status(Code.INTERNAL, "boom", "w1") == AttemptOutcome.fail(Code.INTERNAL, "worker w1: boom")


def test_finished_and_fail_outcomes_end_the_request():
    b = budget()
    b.start()
    assert b.decide(AttemptOutcome(OutcomeKind.FINISHED, finish_reason="stop"), streamed=4).action is Action.DONE
    d = b.decide(AttemptOutcome.fail(Code.INVALID_ARGUMENT, "prompt: empty"), streamed=0)
    assert (d.action, d.code, d.message, d.mid_stream) == (Action.FAIL, Code.INVALID_ARGUMENT, "prompt: empty", False)
    assert b.tried == set() and b.resumes == 0


def test_retry_before_the_first_token_then_give_up_after_max_route_attempts():
    b = budget(max_route_attempts=3)
    for i in range(3):
        b.start()
        d = b.decide(outcome_from_status(Code.UNAVAILABLE, "down", f"w{i}"), streamed=0)
        if i < 2:
            assert d.action is Action.RETRY and b.tried == {f"w{j}" for j in range(i + 1)}
    assert d.action is Action.FAIL and d.code is Code.UNAVAILABLE and not d.mid_stream
    assert d.message == "worker w2 is unavailable (UNAVAILABLE: down) (tried 3 worker(s): w0, w1, w2)"


def test_the_last_failure_names_the_final_status():
    b = budget(max_route_attempts=2)
    b.start()
    assert b.decide(outcome_from_status(Code.UNAVAILABLE, "down", "w0"), streamed=0).action is Action.RETRY
    b.start()
    d = b.decide(outcome_from_status(Code.RESOURCE_EXHAUSTED, "full", "w1"), streamed=0)
    assert (d.action, d.code) == (Action.FAIL, Code.RESOURCE_EXHAUSTED)
    assert d.message == "worker w1 is overloaded: full (tried 2 worker(s): w0, w1)"


def test_resume_after_tokens_up_to_max_resumes():
    b = budget(max_route_attempts=1, max_resumes=2)  # attempts do not limit resumes
    for n in (3, 5):
        b.start()
        d = b.decide(outcome_from_status(Code.UNAVAILABLE, "gone", "w0", streamed=n), streamed=n)
        assert d.action is Action.RESUME and not b.require_prefill
    assert b.resumes == 2 and b.tried == set()  # a resumed-from worker is excluded by its health, not tried
    b.start()
    d = b.decide(AttemptOutcome.resume("w1", "UNAVAILABLE: gone"), streamed=9)
    assert (d.action, d.code, d.mid_stream) == (Action.FAIL, Code.UNAVAILABLE, True)
    assert d.message == ("worker w1 failed mid-stream after 9 generated tokens (UNAVAILABLE: gone); the completion "
                         "is incomplete, retry the request")


def test_without_resumption_a_mid_stream_failure_fails_at_once():
    b = budget(resume=False)
    b.start()
    d = b.decide(AttemptOutcome.resume("w0", "gone"), streamed=1)
    assert d.action is Action.FAIL and d.mid_stream and "after 1 generated tokens (gone)" in d.message
    assert b.resumes == 0


def test_disaggregated_prefill_failure_is_retried_once_with_another_prefill_worker():
    b = budget()  # max_route_attempts=2: one retry
    b.start()
    first = outcome_from_status(Code.ABORTED, "remote prefill failed: p0", "d0", prefill_id="p0")
    assert b.decide(first, streamed=0).action is Action.RETRY
    assert b.require_prefill and b.tried == {"p0"}  # the decode worker stays routable
    b.start()
    second = outcome_from_status(Code.ABORTED, "remote prefill failed: p1", "d0", prefill_id="p1")
    d = b.decide(second, streamed=0)
    assert (d.action, d.code) == (Action.FAIL, Code.UNAVAILABLE)
    assert d.message == "remote prefill failed: p1 (tried 2 worker(s): p0, p1)"


def test_a_decode_failure_after_a_prefill_failure_no_longer_requires_a_prefill_worker():
    b = budget(max_route_attempts=3)
    b.start()
    b.decide(outcome_from_status(Code.ABORTED, "lost", "d0", prefill_id="p0"), streamed=0)
    b.start()
    b.decide(outcome_from_status(Code.UNAVAILABLE, "down", "d0", prefill_id="p1"), streamed=0)
    assert not b.require_prefill and b.tried == {"p0", "d0"}


def test_a_failed_worker_is_excluded_as_the_process_that_failed():
    """A worker that failed a request before its first token is not tried again by it -- as that
    process: once Ray restarted it (a new endpoint or incarnation) it may serve the request, which
    would otherwise wait out worker_wait_s for some other worker."""
    b = budget(max_route_attempts=3)
    d0 = WorkerState("d0", endpoint="10.0.0.1:5000", incarnation="a")
    b.start()
    failed = replace(outcome_from_status(Code.UNAVAILABLE, "down", "d0"), process=worker_process(d0))
    assert b.decide(failed, streamed=0).action is Action.RETRY
    assert b.excludes(d0) and not b.excludes(WorkerState("d1"))
    assert not b.excludes(replace(d0, endpoint="10.0.0.1:5001"))  # restarted on another port
    assert not b.excludes(replace(d0, incarnation="b"))  # or on the same one
    b.start()  # a failure whose process is unknown excludes the worker id whatever its process
    assert b.decide(outcome_from_status(Code.UNAVAILABLE, "down", "d1"), streamed=0).action is Action.RETRY
    assert b.excludes(WorkerState("d1", endpoint="10.0.0.2:5000", incarnation="c"))


def test_no_worker_answers():
    b = budget()
    d = b.no_worker("no healthy worker (2 known)", streamed=0)
    assert (d.action, d.code, d.mid_stream) == (Action.FAIL, Code.UNAVAILABLE, False)
    assert d.message == ("no healthy worker to serve the request (waited up to 10 s or the deadline): "
                         "no healthy worker (2 known)")
    b.start()
    b.decide(outcome_from_status(Code.RESOURCE_EXHAUSTED, "full", "w0"), streamed=0)
    d = b.no_worker("none left", streamed=0)  # after a failure: the failure's status, with the workers tried
    assert (d.code, d.message) == (Code.RESOURCE_EXHAUSTED, "worker w0 is overloaded: full (tried 1 worker(s): w0)")
    b.start()
    b.decide(AttemptOutcome.resume("w1", "gone"), streamed=4)
    d = b.no_worker("none left", streamed=4)
    assert d.mid_stream and d.code is Code.UNAVAILABLE
    assert d.message == ("worker w1 failed mid-stream (gone); no healthy worker to resume on within 10 s after "
                         "4 generated tokens; the completion is incomplete, retry the request")


def test_budget_reads_its_limits_from_the_router_config():
    config = RouterConfig(tokenizer_path="/nonexistent", max_route_attempts=4, max_resumes=1,
                          resume_on_worker_failure=False, worker_wait_s=2.5)
    assert AttemptBudget.from_config(config) == AttemptBudget(4, 1, False, 2.5)


def test_a_migrated_outcome_is_followed_once_and_spends_no_budget():
    from router.attempt import Action, AttemptBudget, AttemptOutcome

    budget = AttemptBudget(max_route_attempts=1, max_resumes=0, resume_on_worker_failure=False, worker_wait_s=0)
    budget.start()
    outcome = AttemptOutcome.migrated("w0", "w1", "mig/1")
    assert budget.decide(outcome, streamed=5).action is Action.MIGRATE
    assert budget.take_migration() == outcome and budget.take_migration() is None
    assert budget.resumes == 0 and not budget.tried and budget.migrations == 1
