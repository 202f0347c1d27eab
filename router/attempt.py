"""What one attempt at a request ends with (``AttemptOutcome``), and the one place that decides
what happens next (``AttemptBudget.decide``): done, retry on another worker, resume on another
worker, or fail with a status for the client.

Terms:
    attempt      one Submit stream to one route (a worker, or a prefill + decode pair), from the
                 route's choice to the stream's end. A request makes one or more attempts.
    outcome      how an attempt ended, as a value (router/worker_stream.py builds it; nothing is
                 raised for a worker failure):
                     FINISHED  the stream ended with a finish reason (or at a stop string)
                     RETRY     the worker failed before any token reached the client: another
                               worker may serve the request from the start
                     RESUME    the worker failed after tokens reached the client: another worker
                               may continue from prompt + the streamed tokens
                     FAIL      the client gets ``code`` + ``message`` now (bad input passed
                               through, deadline, an error no other worker would fix)
                     MIGRATED  the worker moved the running request to another worker (live
                               migration, workers/handoff/migration_service.py): the next attempt attaches
                               to ``target_id`` with ``migration_id`` and continues from the exact
                               token index; nothing is recomputed and no budget is spent
    budget       the limits of one request (``max_route_attempts`` attempts while nothing was
                 streamed, ``max_resumes`` resumes, and only with ``resume_on_worker_failure``),
                 with the workers tried so far (never picked again for this request while the process
                 that failed it runs: a worker Ray restarts is a new chance).

Error mapping (``outcome_from_status``: worker status -> outcome -> client status):
    INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION  FAIL, passed through (the message names the field)
    UNAVAILABLE, CANCELLED (by the worker, not by us)    the worker died or is shutting down: reported
                                                         unhealthy; RETRY / RESUME; at the end UNAVAILABLE
    RESOURCE_EXHAUSTED before the first token            worker queue full: RETRY (not reported); at the
                                                         end RESOURCE_EXHAUSTED
    ABORTED before the first token, disaggregated route  the prefill half failed: prefill worker reported,
                                                         RETRY colocated on a decode worker; at the end
                                                         UNAVAILABLE
    DEADLINE_EXCEEDED                                     FAIL, DEADLINE_EXCEEDED (the client's deadline is
                                                         the worker call's deadline)
    anything else (INTERNAL, UNKNOWN, ...)                FAIL, passed through prefixed with the worker id
A stream that ends without a finish reason, or one the directory cancels because it declared the
worker dead, counts as the worker down (UNAVAILABLE).

Worked example (max_route_attempts=2, max_resumes=2; a prefill + decode route p0/d0, prefill
workers p0, p1)::

    budget = AttemptBudget.from_config(config)
    budget.start()                                     # attempt 1 on (d0, p0)
    budget.decide(AttemptOutcome.retry(UNAVAILABLE, "remote prefill failed", "p0", prefill_failed=True),
                  streamed=0)
    # -> Decision(RETRY); budget.tried == {"p0"}, budget.require_prefill: the next route retries a
    #    failed prefill half (the disaggregated policy runs it colocated on a decode worker)
    budget.start()                                     # attempt 2 on (d0, p1)
    budget.decide(AttemptOutcome.retry(UNAVAILABLE, "remote prefill failed", "p1", prefill_failed=True),
                  streamed=0)
    # -> Decision(FAIL, UNAVAILABLE, "remote prefill failed (tried 2 worker(s): p0, p1)")
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

from protos.duet.v1 import duet_pb2
from router.config import RouterConfig
from router.policies.base import WorkerState


class OutcomeKind(enum.Enum):
    FINISHED = "finished"
    RETRY = "retry"
    RESUME = "resume"
    FAIL = "fail"
    MIGRATED = "migrated"


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended. Build it with the class methods.

    code, message   the client's status if the request ends here (for RETRY and RESUME: if it
                    is the last attempt), the message naming the worker.
    worker_id       RETRY / RESUME: the worker that failed (the prefill worker when
                    ``prefill_failed``).
    prefill_failed  only the prefill half of a disaggregated route failed: the next route is
                    its retry (router/policies/disagg.py: colocated on a decode worker).
    report          the worker looks dead: the pipeline reports it to the directory (no traffic
                    until a poll succeeds after the cooldown).
    process         RETRY: which process of ``worker_id`` failed (its endpoint and incarnation,
                    ``worker_process``; set by the pipeline from the attempt's lease): the request
                    avoids that process only, so a worker Ray restarted meanwhile serves it again.
                    "" = the worker id whatever its process.
    reason          what happened to the worker (the report's text; for RESUME also the message
                    when resumes run out).
    finish_reason   FINISHED: the reason's short name (stop, length, abort).
    response        FINISHED: the client's last GenerateResponse (finish reason and usage); the
                    pipeline sends it once the attempt's accounting is done.
    """

    kind: OutcomeKind
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    worker_id: str = ""
    prefill_failed: bool = False
    report: bool = False
    reason: str = ""
    finish_reason: str = ""
    response: duet_pb2.GenerateResponse | None = field(default=None, compare=False)
    target_id: str = ""  # MIGRATED: the worker the request now runs on
    migration_id: str = ""  # MIGRATED: what the attach sends (SubmitRequest.migration_id)
    process: str = ""

    @classmethod
    def finished(cls, finish_reason: str, response: duet_pb2.GenerateResponse) -> AttemptOutcome:
        return cls(OutcomeKind.FINISHED, finish_reason=finish_reason, response=response)

    @classmethod
    def retry(cls, code: grpc.StatusCode, message: str, worker_id: str, *, prefill_failed: bool = False,
              report: bool = False, reason: str = "") -> AttemptOutcome:
        return cls(OutcomeKind.RETRY, code, message, worker_id, prefill_failed=prefill_failed, report=report,
                   reason=reason)

    @classmethod
    def resume(cls, worker_id: str, reason: str) -> AttemptOutcome:
        """The worker failed (and is reported) after tokens reached the client."""
        return cls(OutcomeKind.RESUME, grpc.StatusCode.UNAVAILABLE, f"worker {worker_id} failed mid-stream ({reason})",
                   worker_id, report=True, reason=reason)

    @classmethod
    def migrated(cls, worker_id: str, target_id: str, migration_id: str) -> AttemptOutcome:
        """``worker_id`` handed the running request to ``target_id`` (its stream ended with migrated_to)."""
        return cls(OutcomeKind.MIGRATED, message=f"migrated from {worker_id} to {target_id}", worker_id=worker_id,
                   target_id=target_id, migration_id=migration_id)

    @classmethod
    def fail(cls, code: grpc.StatusCode, message: str) -> AttemptOutcome:
        return cls(OutcomeKind.FAIL, code, message)

    @classmethod
    def worker_down(cls, worker_id: str, reason: str, streamed: int) -> AttemptOutcome:
        """The worker died, shut down, or was declared dead: retry before the first token, else resume."""
        if streamed == 0:
            return cls.retry(grpc.StatusCode.UNAVAILABLE, f"worker {worker_id} is unavailable ({reason})", worker_id,
                             report=True, reason=reason)
        return cls.resume(worker_id, reason)


def worker_process(worker: WorkerState) -> str:
    """One process of a worker: its endpoint and incarnation (a restart changes at least one)."""
    return f"{worker.endpoint}#{worker.incarnation}"


PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
_WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def outcome_from_status(code: grpc.StatusCode, details: str, worker_id: str, *, prefill_id: str | None = None,
                        streamed: int = 0) -> AttemptOutcome:
    """The outcome of a Submit stream that ended with ``code`` (the error mapping above).
    worker_id: the decode (or colocated) worker; prefill_id: the prefill worker of a
    disaggregated route; streamed: tokens that reached the client so far."""
    if code == grpc.StatusCode.ABORTED and streamed == 0 and prefill_id is not None:
        return AttemptOutcome.retry(grpc.StatusCode.UNAVAILABLE, details or "remote prefill failed", prefill_id,
                                    prefill_failed=True, report=True, reason=details)
    if code in PASS_THROUGH:
        return AttemptOutcome.fail(code, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return AttemptOutcome.fail(code, f"deadline exceeded after {streamed} generated tokens")
    if code in _WORKER_GONE:
        return AttemptOutcome.worker_down(worker_id, f"{code.name}: {details}", streamed)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and streamed == 0:
        return AttemptOutcome.retry(code, f"worker {worker_id} is overloaded: {details}", worker_id)
    return AttemptOutcome.fail(code, f"worker {worker_id}: {details}")


class Action(enum.Enum):
    DONE = "done"  # the client has its whole answer
    RETRY = "retried"  # route again from the start (``AttemptBudget.tried`` excluded)
    RESUME = "resumed"  # route again from prompt + streamed tokens
    MIGRATE = "migrated"  # attach to the migration target (``AttemptBudget.migration``)
    FAIL = "failed"  # raise RequestError(code, message)


@dataclass(frozen=True)
class Decision:
    """What the pipeline does after an attempt. ``mid_stream``: a FAIL because a worker failed
    after tokens reached the client and it could not resume (the completion is incomplete)."""

    action: Action
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    mid_stream: bool = False


@dataclass
class AttemptBudget:
    """One request's retry and resume state; ``decide`` is the only place that turns an outcome
    into retry / resume / fail. Call ``start`` when an attempt begins (a route was chosen)."""

    max_route_attempts: int
    max_resumes: int
    resume_on_worker_failure: bool
    worker_wait_s: float
    # the workers that failed this request before its first token -> the process that failed ("" = any)
    tried_process: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    resumes: int = 0
    require_prefill: bool = False  # the last failure was a prefill half: the next route needs one
    last: AttemptOutcome | None = None  # the latest RETRY / RESUME outcome
    migration: AttemptOutcome | None = None  # set by a MIGRATED outcome, for the next attempt only
    migrations: int = 0

    @classmethod
    def from_config(cls, config: RouterConfig) -> AttemptBudget:
        return cls(config.max_route_attempts, config.max_resumes, config.resume_on_worker_failure,
                   config.worker_wait_s)

    def start(self) -> None:
        self.attempts += 1

    def take_migration(self) -> AttemptOutcome | None:
        """The MIGRATED outcome the next attempt follows (once), or None."""
        migration, self.migration = self.migration, None
        return migration

    def decide(self, outcome: AttemptOutcome, streamed: int) -> Decision:
        """The next step after ``outcome``; ``streamed``: tokens that reached the client so far."""
        if outcome.kind is OutcomeKind.FINISHED:
            return Decision(Action.DONE)
        if outcome.kind is OutcomeKind.FAIL:
            return Decision(Action.FAIL, outcome.code, outcome.message)
        if outcome.kind is OutcomeKind.MIGRATED:
            self.migration = outcome
            self.migrations += 1
            return Decision(Action.MIGRATE)
        if outcome.kind is OutcomeKind.RETRY:
            assert streamed == 0, "a retry from the start after tokens reached the client"
            self.last = outcome
            self.require_prefill = outcome.prefill_failed
            self.tried_process[outcome.worker_id] = outcome.process
            if self.attempts >= self.max_route_attempts:
                return self._give_up()
            return Decision(Action.RETRY)
        assert outcome.kind is OutcomeKind.RESUME and streamed > 0, outcome
        if not self.resume_on_worker_failure or self.resumes >= self.max_resumes:
            return Decision(Action.FAIL, grpc.StatusCode.UNAVAILABLE,
                            f"worker {outcome.worker_id} failed mid-stream after {streamed} generated tokens "
                            f"({outcome.reason}); the completion is incomplete, retry the request", mid_stream=True)
        self.last = outcome
        self.require_prefill = False
        self.resumes += 1
        return Decision(Action.RESUME)

    @property
    def tried(self) -> set[str]:
        """The worker ids that failed this request before its first token."""
        return set(self.tried_process)

    def excludes(self, worker: WorkerState) -> bool:
        """Whether the request must not be routed to ``worker``: it failed this request before its
        first token -- the same process (a worker restarted since, with a new endpoint or
        incarnation, is a new chance), or any when the failed process is unknown."""
        if worker.worker_id not in self.tried_process:
            return False
        failed = self.tried_process[worker.worker_id]
        return not failed or failed == worker_process(worker)

    def no_worker(self, reason: str, streamed: int, wait: str | None = None) -> Decision:
        """No route within ``worker_wait_s`` (or the deadline; ``wait`` says otherwise, e.g. a
        request held while its pool woke from zero: router/hold.py): always a FAIL."""
        if streamed:
            return Decision(Action.FAIL, grpc.StatusCode.UNAVAILABLE,
                            f"{self.last.message if self.last else reason}; no healthy worker to resume on within "
                            f"{self.worker_wait_s:g} s after {streamed} generated tokens; the completion is "
                            "incomplete, retry the request", mid_stream=True)
        if self.last is not None:
            return self._give_up()
        wait = wait or f"waited up to {self.worker_wait_s:g} s or the deadline"
        return Decision(Action.FAIL, grpc.StatusCode.UNAVAILABLE, f"no healthy worker to serve the request ({wait}): "
                        f"{reason}")

    def _give_up(self) -> Decision:
        assert self.last is not None
        return Decision(Action.FAIL, self.last.code,
                        f"{self.last.message} (tried {len(self.tried)} worker(s): {', '.join(sorted(self.tried))})")
