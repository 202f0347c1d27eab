"""One attempt of a request (``stream_attempt``): the Submit stream to one route, incrementally
detokenized into the client's GenerateResponses, ending with the attempt's ``AttemptOutcome``
(router/attempt.py). A worker failure is an outcome, never an exception; the only exception that
leaves is the cancellation of the request itself (the client went away).

Terms:
    delta     one worker SubmitResponse: the token ids generated since the previous one.
    progress  what reached the client so far (``Progress``); it outlives the attempts of one
              request, so a resumed attempt continues from prompt + streamed tokens.
    route     a colocated (or decode-only) worker lease, plus a prefill worker lease for a
              disaggregated route: the Submit goes to the decode worker with ``remote_prefill``
              naming the prefill worker, which computes the prompt's KV and sends it directly.

Cancellation: the worker call is cancelled whenever the attempt ends without the worker's last
message (the client cancelled, its deadline passed, a stop string ended the stream first, or the
consumer closed the stream); the worker then aborts the request and frees its KV blocks. The
directory cancels the call itself when it declares the decode worker (or, before the first token,
the prefill worker) dead: that cancellation is the worker's failure, told apart from the request's
own cancellation by ``Task.cancelling()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import grpc

from protos.duet.v1 import duet_pb2
from protos.duet.worker.v1 import worker_pb2
from router.attempt import PASS_THROUGH, AttemptOutcome, OutcomeKind, outcome_from_status
from router.policies.prefix_pull import PullSource
from router.preprocess import PreparedRequest, RequestError
from router.request_metrics import RequestClock, RequestMetrics
from router.workers import WorkerLease
from workers.detokenizer import IncrementalDetokenizer  # the one sanctioned workers import (pure Python)

logger = logging.getLogger(__name__)

_FINISH = {
    worker_pb2.FINISH_REASON_STOP: duet_pb2.FINISH_REASON_STOP,
    worker_pb2.FINISH_REASON_LENGTH: duet_pb2.FINISH_REASON_LENGTH,
    worker_pb2.FINISH_REASON_ABORT: duet_pb2.FINISH_REASON_ABORT,
}

AttemptEvent = duet_pb2.GenerateResponse | AttemptOutcome


@dataclass
class Progress:
    """What reached the client so far; outlives the worker streams of one request (resumption)."""

    detok: IncrementalDetokenizer
    clock: RequestClock
    token_ids: list[int] = field(default_factory=list)

    def resume_from(self, token_ids: Sequence[int], text_chars: int) -> None:
        """Continue a request a client resumes (GenerateRequest.resume): its tokens count as streamed,
        and the detokenizer replays them so the next text continues right after the ``text_chars``
        characters the client holds (held-back text included). RequestError when they cannot
        come from this request."""
        assert not self.token_ids, "resume_from on a request that already streamed"
        for t in token_ids:
            _, stopped = self.detok.add(t)
            if stopped:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "resume.token_ids: the request already "
                                   "ended at a stop string within the tokens received")
        if text_chars > len(self.detok.text):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"resume.text_chars: {text_chars} characters "
                               f"received, but the {len(token_ids)} tokens decode to {len(self.detok.text)}")
        self.detok.emitted = text_chars
        self.token_ids.extend(token_ids)

    def submit_request(self, prep: PreparedRequest, migration_id: str = "") -> worker_pb2.SubmitRequest:
        """The worker request: the prepared one, or (resuming) prompt + streamed ids with the rest
        of max_tokens and min_tokens; the streamed ids still count as generated for the penalties
        (resumed_output_tokens). Context limits hold: prompt + max_tokens was clamped to the context.
        migration_id: attach to the request migrated to this worker (falls back to the resume there)."""
        request = prep.submit_request()
        request.migration_id = migration_id
        if self.token_ids:
            request.prompt_token_ids.extend(self.token_ids)
            request.resumed_output_tokens = len(self.token_ids)
            request.sampling.max_tokens = prep.sampling.max_tokens - len(self.token_ids)
            request.sampling.min_tokens = max(0, prep.sampling.min_tokens - len(self.token_ids))
        return request


async def stream_attempt(prep: PreparedRequest, lease: WorkerLease, prefill: WorkerLease | None,
                         progress: Progress, deadline: float | None,
                         metrics: RequestMetrics, pull: PullSource | None = None,
                         migration_id: str = "", drafter: worker_pb2.DrafterRef | None = None) -> AsyncGenerator[AttemptEvent, None]:
    """Yield the client's GenerateResponses of one attempt, then exactly one AttemptOutcome (the
    last event; a FINISHED one carries the last response). ``deadline`` (time.monotonic) bounds the worker call.
    ``pull``: the prefix the worker pulls from another one (Submit.prefix_source). migration_id: this
    attempt attaches to a request migrated to ``lease``'s worker. drafter: the drafter replica the
    request drafts on (Submit.drafter). Raises only asyncio.CancelledError,
    when the request itself is cancelled."""
    started = time.monotonic()
    timeout = None if deadline is None else max(deadline - started, 0.001)
    request = progress.submit_request(prep, migration_id)
    streamed_before = len(progress.token_ids)
    if prefill is not None:
        state = prefill.state
        request.remote_prefill.CopyFrom(worker_pb2.RemotePrefill(
            worker_id=prefill.worker_id, endpoint=state.endpoint, incarnation=state.incarnation))
    if drafter is not None:
        request.drafter.CopyFrom(drafter)
    if pull is not None:
        request.prefix_source.CopyFrom(worker_pb2.PrefixSource(
            worker_id=pull.worker_id, endpoint=pull.endpoint, incarnation=pull.incarnation, num_tokens=pull.num_tokens))
    call = lease.submit(request, timeout)
    lease.call = call
    if prefill is not None:  # a prefill worker declared dead cancels the call too (it may hang on it)
        prefill.call = call
    metrics.routed(progress.clock, prefill.pool if prefill is not None else lease.pool, lease.pool,
                   len(prep.prompt_token_ids))
    try:
        outcome: AttemptOutcome | None = None
        try:
            async for delta in call:
                ids, text, stopped = _detokenize(progress.detok, delta.token_ids)
                logprobs = _logprobs(delta.logprobs[: len(ids)])  # cut with the ids at a stop string
                progress.token_ids.extend(ids)
                if ids:
                    metrics.chunk(progress.clock, lease.pool)
                    lease.observe_chunk(len(ids), time.monotonic())
                    if prefill is not None:  # the KV arrived: the prefill worker's part is done
                        prefill.call = None
                if stopped or delta.HasField("finish_reason"):
                    outcome = _finish(prep, lease, progress, delta, ids, text, stopped, started, metrics, logprobs)
                    break
                if ids:
                    yield duet_pb2.GenerateResponse(request_id=prep.request_id, text=text, token_ids=ids,
                                                    logprobs=logprobs)
                if delta.HasField("migrated_to"):
                    outcome = _migrated(prep, lease, delta.migrated_to, len(progress.token_ids) - streamed_before)
                    break
            else:
                outcome = AttemptOutcome.worker_down(lease.worker_id, "its stream ended without a finish reason",
                                                     len(progress.token_ids))
        except grpc.aio.AioRpcError as e:
            outcome = _rpc_error_outcome(prep, lease, prefill, progress, e)
        except asyncio.CancelledError:
            outcome = _declared_dead(lease, prefill, progress)
            if outcome is None:
                raise
        yield outcome
    finally:
        if not call.done():
            call.cancel()  # the worker aborts the request and frees its KV blocks


def _finish(prep: PreparedRequest, lease: WorkerLease, progress: Progress, delta: worker_pb2.SubmitResponse,
            ids: list[int], text: str, stopped: bool, started: float,
            metrics: RequestMetrics, logprobs: list[duet_pb2.TokenLogprob]) -> AttemptOutcome:
    """The FINISHED outcome, with the client's last response (flushing the detokenizer)."""
    num_out = len(progress.token_ids)
    finish = duet_pb2.FINISH_REASON_STOP if stopped else _FINISH.get(delta.finish_reason, duet_pb2.FINISH_REASON_ABORT)
    usage = duet_pb2.Usage(prompt_tokens=len(prep.prompt_token_ids), completion_tokens=num_out,
                           cached_prompt_tokens=delta.usage.cached_prompt_tokens)
    reason = duet_pb2.FinishReason.Name(finish)[len("FINISH_REASON_"):].lower()
    metrics.finished_request(progress.clock, lease.pool, num_out, reason)
    logger.info("request %s (internal %s) on %s: %d prompt + %d completion tokens, %s, %.1f ms",
                prep.request_id, prep.internal_id, lease.worker_id, usage.prompt_tokens, num_out,
                duet_pb2.FinishReason.Name(finish), 1e3 * (time.monotonic() - started))
    response = duet_pb2.GenerateResponse(request_id=prep.request_id, text=text + progress.detok.flush(),
                                         token_ids=ids, finish_reason=finish, usage=usage, logprobs=logprobs)
    return AttemptOutcome.finished(reason, response)


def _migrated(prep: PreparedRequest, lease: WorkerLease, moved: worker_pb2.MigratedTo, attempt_tokens: int
              ) -> AttemptOutcome:
    """The MIGRATED outcome; without a migration id when the worker's token count disagrees with
    what this attempt streamed (the next attempt then resumes by recompute: never a gap or a repeat)."""
    migration_id = moved.migration_id
    if moved.num_output_tokens != attempt_tokens:
        logger.warning("request %s: %s migrated it after %d tokens, %d streamed here; resuming by recompute",
                       prep.request_id, lease.worker_id, moved.num_output_tokens, attempt_tokens)
        migration_id = ""
    logger.info("request %s (internal %s): migrated from %s to %s", prep.request_id, prep.internal_id,
                lease.worker_id, moved.worker_id)
    return AttemptOutcome.migrated(lease.worker_id, moved.worker_id, migration_id)


def _rpc_error_outcome(prep: PreparedRequest, lease: WorkerLease, prefill: WorkerLease | None, progress: Progress,
                       e: grpc.aio.AioRpcError) -> AttemptOutcome:
    code, details = e.code(), e.details() or ""
    outcome = outcome_from_status(code, details, lease.worker_id,
                                  prefill_id=prefill.worker_id if prefill is not None else None,
                                  streamed=len(progress.token_ids))
    if outcome.kind is OutcomeKind.FAIL and code not in PASS_THROUGH and code != grpc.StatusCode.DEADLINE_EXCEEDED:
        logger.warning("request %s: worker %s failed with %s: %s", prep.request_id, lease.worker_id, code.name, details)
    return outcome


def _declared_dead(lease: WorkerLease, prefill: WorkerLease | None, progress: Progress) -> AttemptOutcome | None:
    """The outcome when the call was cancelled because the directory declared a worker of the route
    dead; None when the request itself was cancelled (the caller re-raises)."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        return None
    streamed = len(progress.token_ids)
    if lease.failure is not None:
        return AttemptOutcome.worker_down(lease.worker_id, lease.failure, streamed)
    if prefill is not None and prefill.failure is not None and streamed == 0:
        # the directory already marked it unhealthy: nothing to report
        return AttemptOutcome.retry(grpc.StatusCode.UNAVAILABLE, prefill.failure, prefill.worker_id,
                                    prefill_failed=True)
    return None


def _logprobs(items) -> list[duet_pb2.TokenLogprob]:
    """Worker TokenLogprobs -> public ones (same fields)."""
    return [duet_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                  top_logprobs=[duet_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob)
                                                for t in lp.top_logprobs]) for lp in items]


def _detokenize(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[int], str, bool]:
    """Feed one delta's ids; stop at (and keep) the id that completes a stop string."""
    ids: list[int] = []
    text: list[str] = []
    for t in token_ids:
        ids.append(t)
        piece, stopped = detok.add(t)
        text.append(piece)
        if stopped:
            return ids, "".join(text), True
    return ids, "".join(text), False
