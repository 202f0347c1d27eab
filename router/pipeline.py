"""The request path through the router, in one method (``Pipeline.generate``):

    prepare (tokenize, validate)  ->  admission slot  ->  route (policy picks a worker, or a
    (prefill, decode) pair: router/policies/disagg.py)  ->  Submit stream  ->  incremental
    detokenization + stop strings  ->  GenerateResponse stream

Disaggregated routes: the Submit goes to the decode worker with ``remote_prefill`` naming the
prefill worker; the decode worker has it prefill and send the KV directly (the router never sees
KV). ABORTED before the first token means the prefill half failed (prefill worker down or
restarted, transfer lost or rejected): the prefill worker is reported failed and the request is
retried once with another prefill worker; with none left it ends with UNAVAILABLE.

Terms:
    delta        one worker SubmitResponse: the token ids generated since the previous one.
    first token  a failure before any token reached the client is retried on another worker
                 (up to ``max_route_attempts`` workers, for UNAVAILABLE and a full worker queue).
    resume       a worker that dies after tokens reached the client: the request continues on
                 another healthy worker from prompt + the tokens streamed so far, with the rest of
                 its max_tokens (up to ``max_resumes`` times). The client sees one uninterrupted stream. Under greedy decoding
                 the output is identical to an uninterrupted run; a sampled request continues with
                 a fresh sampler state (valid samples, not the same ones). With
                 ``resume_on_worker_failure`` off, or once resumes run out, the stream ends with
                 UNAVAILABLE, retryable by the client.
    waiting      with no healthy worker (all restarting, say), a request waits up to
                 ``worker_wait_s`` (and its deadline) for one that it has not failed on, holding
                 its admission slot, instead of failing at once.

Error mapping (worker status -> client status):
    INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION  passed through (the message names the field)
    UNAVAILABLE, CANCELLED (by the worker, not by us)    the worker died or is shutting down:
                                                         worker marked unhealthy; client UNAVAILABLE
    RESOURCE_EXHAUSTED                                    worker queue full: try another worker, else
                                                         RESOURCE_EXHAUSTED
    DEADLINE_EXCEEDED                                     DEADLINE_EXCEEDED (the client's deadline is
                                                         the worker call's deadline)
    anything else (INTERNAL, UNKNOWN, ...)                passed through, prefixed with the worker id
A stream that ends without a finish reason counts as a worker failure (UNAVAILABLE).

Cancellation: when the client cancels or its deadline passes, grpc cancels the handler task; the
``finally`` around the Submit stream cancels the worker call, and the worker aborts the request
and frees its KV blocks. When the router's detokenizer finds a stop string first, it ends the
client's stream with STOP and cancels the worker call the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc

from protos.duet.v1 import duet_pb2
from protos.duet.worker.v1 import worker_pb2
from router.admission import AdmissionController, AdmissionRejected
from router.config import RouterConfig
from router.policies import NoWorkersAvailable, RouteRequest, RoutingPolicy
from router.policies.disagg import DisaggRouter, Route
from router.preprocess import PreparedRequest, RequestError, ServedModel, prepare_request
from router.request_metrics import RequestClock, RequestMetrics
from router.workers import WorkerDirectory, WorkerLease
from workers.detokenizer import IncrementalDetokenizer  # the one sanctioned workers import (pure Python)

logger = logging.getLogger(__name__)

_FINISH = {
    worker_pb2.FINISH_REASON_STOP: duet_pb2.FINISH_REASON_STOP,
    worker_pb2.FINISH_REASON_LENGTH: duet_pb2.FINISH_REASON_LENGTH,
    worker_pb2.FINISH_REASON_ABORT: duet_pb2.FINISH_REASON_ABORT,
}
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
_WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
_DEADLINE_MARGIN_S = 0.25  # a request waiting for a worker gives up this long before its deadline
_OFFLOAD_CHARS = 16_384  # prompts longer than this are tokenized on a thread, off the event loop


class _RetryElsewhere(Exception):
    """The worker failed; another worker may serve the request (from the start when nothing was
    streamed yet, else resuming after what was streamed). prefill_failed: only the prefill half of
    a disaggregated route failed (retry with another prefill worker)."""

    def __init__(self, error: RequestError, prefill_failed: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.prefill_failed = prefill_failed


@dataclass
class _Progress:
    """What reached the client so far; outlives the worker streams of one request (resumption)."""

    detok: IncrementalDetokenizer
    clock: RequestClock
    token_ids: list[int] = field(default_factory=list)
    resumes: int = 0

    def submit_request(self, prep: PreparedRequest) -> worker_pb2.SubmitRequest:
        """The worker request: the prepared one, or (resuming) prompt + streamed ids with the rest
        of max_tokens and min_tokens; the streamed ids still count as generated for the penalties
        (resumed_output_tokens). Context limits hold: prompt + max_tokens was clamped to the context."""
        request = prep.submit_request()
        if self.token_ids:
            request.prompt_token_ids.extend(self.token_ids)
            request.resumed_output_tokens = len(self.token_ids)
            request.sampling.max_tokens = prep.sampling.max_tokens - len(self.token_ids)
            request.sampling.min_tokens = max(0, prep.sampling.min_tokens - len(self.token_ids))
        return request


class Pipeline:
    def __init__(self, config: RouterConfig, model: ServedModel, directory: WorkerDirectory,
                 policy: RoutingPolicy, admission: AdmissionController, metrics: RequestMetrics | None = None) -> None:
        self.config = config
        self.model = model
        self.directory = directory
        self.policy = policy
        self.router = DisaggRouter(policy, block_size=config.disagg_block_size,
                                   min_prompt_tokens=config.disagg_min_prompt_tokens)
        self.admission = admission
        self.counts: Counter[str] = Counter()
        self.metrics = metrics or RequestMetrics()  # per-pool latency histograms (router/request_metrics.py)

    async def generate(self, request: duet_pb2.GenerateRequest, *,
                       deadline: float | None = None) -> AsyncIterator[duet_pb2.GenerateResponse]:
        """Stream the completion of ``request``; ``deadline`` is a time.monotonic() instant.
        Raises RequestError (status code + message) for anything the client should see."""
        self.counts["requests"] += 1
        received = time.monotonic()
        try:
            prep = await self._prepare(request)
            async with self.admission.slot():
                async for response in self._route_and_stream(prep, deadline, received):
                    yield response
        except AdmissionRejected as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except RequestError as e:
            self.counts[f"error_{e.code.name.lower()}"] += 1
            raise

    async def _prepare(self, request: duet_pb2.GenerateRequest) -> PreparedRequest:
        size = len(request.prompt) + sum(len(m.content) for m in request.messages.messages)
        if size > _OFFLOAD_CHARS:
            return await asyncio.to_thread(prepare_request, request, self.model, self.config)
        return prepare_request(request, self.model, self.config)

    async def _route_and_stream(self, prep: PreparedRequest, deadline: float | None,
                                received: float) -> AsyncIterator[duet_pb2.GenerateResponse]:
        progress = _Progress(IncrementalDetokenizer(self.model.tokenizer, prep.prompt_token_ids, stop=prep.stop),
                             RequestClock(received))
        tried: set[str] = set()  # workers that failed this request before its first token (either half)
        last: RequestError | None = None
        attempts = 0
        retry_prefill = False
        while True:
            route = RouteRequest(prep.internal_id, prep.prompt_token_ids + progress.token_ids,
                                 prep.sampling.max_tokens - len(progress.token_ids))
            try:
                chosen = await self._select(route, tried, deadline, retry_prefill)
            except NoWorkersAvailable as e:
                if progress.token_ids:
                    self.counts["failed_mid_stream"] += 1
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{last.message if last else e}; no healthy worker "
                                       f"to resume on within {self.config.worker_wait_s:g} s after "
                                       f"{len(progress.token_ids)} generated tokens; the completion is incomplete, "
                                       "retry the request") from None
                if last is not None:
                    break
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker to serve the request (waited up "
                                   f"to {self.config.worker_wait_s:g} s or the deadline): {e}") from None
            attempts += 1
            lease = self.directory.begin(chosen.decode_id, route)
            prefill = self.directory.begin(chosen.prefill_id, route) if chosen.prefill_id else None
            try:
                async for response in self._stream(prep, lease, deadline, progress, prefill):
                    yield response
                return
            except _RetryElsewhere as r:
                last = r.error
                if not progress.token_ids:
                    retry_prefill = r.prefill_failed
                    tried.add(chosen.prefill_id if r.prefill_failed else chosen.decode_id)
                    if attempts >= self.config.max_route_attempts:
                        break
                    self.counts["retried"] += 1
                    logger.warning("request %s: %s; trying another worker", prep.request_id, r.error.message)
                else:
                    retry_prefill = False
                    progress.resumes += 1
                    self.counts["resumed"] += 1
                    logger.warning("request %s: %s; resuming after %d streamed tokens on another worker (%d/%d)",
                                   prep.request_id, r.error.message, len(progress.token_ids), progress.resumes,
                                   self.config.max_resumes)
            finally:
                self.directory.end(lease)
                if prefill is not None:
                    self.directory.end(prefill)
                self.router.on_request_complete(chosen.decode_id, prep.internal_id)
        assert last is not None
        if retry_prefill:
            last = RequestError(grpc.StatusCode.UNAVAILABLE, last.message)
        raise RequestError(last.code, f"{last.message} (tried {len(tried)} worker(s): {', '.join(sorted(tried))})")

    async def _select(self, route: RouteRequest, tried: set[str], deadline: float | None,
                      require_prefill: bool) -> Route:
        """The route among healthy workers not in ``tried`` (a prefill worker required after a
        prefill failure); with none, wait up to ``worker_wait_s`` (and the deadline) while a worker
        not in ``tried`` may come back or join."""
        wait_until = time.monotonic() + self.config.worker_wait_s
        if deadline is not None:  # stop in time to answer UNAVAILABLE (not DEADLINE_EXCEEDED)
            wait_until = min(wait_until, deadline - _DEADLINE_MARGIN_S)
        waited = False
        while True:
            workers = self.directory.snapshot()
            if tried:
                workers = [replace(w, healthy=False) if w.worker_id in tried else w for w in workers]
            try:
                chosen = self.router.select(route, workers, require_prefill=require_prefill)
                if waited:
                    self.counts["waited_for_worker"] += 1
                return chosen
            except NoWorkersAvailable:
                needed = [w for w in workers if w.role == "prefill"] if require_prefill else workers
                # (no members at all: restarting workers rejoin, so wait for them too)
                hopeless = (not needed) if require_prefill else bool(needed)
                if time.monotonic() >= wait_until or (hopeless and all(w.worker_id in tried for w in needed)):
                    raise
            waited = True
            await asyncio.sleep(0.05)

    async def _stream(self, prep: PreparedRequest, lease: WorkerLease, deadline: float | None,
                      progress: _Progress, prefill: WorkerLease | None = None
                      ) -> AsyncIterator[duet_pb2.GenerateResponse]:
        started = time.monotonic()
        timeout = None if deadline is None else max(deadline - started, 0.001)
        request = progress.submit_request(prep)
        if prefill is not None:
            state = prefill.state
            request.remote_prefill.CopyFrom(worker_pb2.RemotePrefill(
                worker_id=prefill.worker_id, endpoint=state.endpoint, incarnation=state.incarnation))
        call = lease.stub.Submit(request, timeout=timeout)
        lease.call = call
        if prefill is not None:  # a prefill worker declared dead cancels the call too (it may hang on it)
            prefill.call = call
        self.metrics.routed(progress.clock, prefill.pool if prefill is not None else lease.pool, lease.pool,
                            len(prep.prompt_token_ids))
        detok = progress.detok
        num_out = len(progress.token_ids)
        try:
            async for delta in call:
                ids, text, stopped = _detokenize(detok, delta.token_ids)
                logprobs = _logprobs(delta.logprobs[: len(ids)])
                progress.token_ids.extend(ids)
                num_out = len(progress.token_ids)
                if ids:
                    self.metrics.chunk(progress.clock, lease.pool)
                if not stopped and not delta.HasField("finish_reason"):
                    if ids:
                        yield duet_pb2.GenerateResponse(request_id=prep.request_id, text=text, token_ids=ids,
                                                        logprobs=logprobs)
                    continue
                finish = duet_pb2.FINISH_REASON_STOP if stopped else _FINISH.get(delta.finish_reason,
                                                                                 duet_pb2.FINISH_REASON_ABORT)
                usage = duet_pb2.Usage(prompt_tokens=len(prep.prompt_token_ids), completion_tokens=num_out,
                                       cached_prompt_tokens=delta.usage.cached_prompt_tokens)
                reason = duet_pb2.FinishReason.Name(finish)[14:].lower()
                self.counts[f"finish_{reason}"] += 1
                self.metrics.finished_request(progress.clock, lease.pool, num_out, reason)
                logger.info("request %s (internal %s) on %s: %d prompt + %d completion tokens, %s, %.1f ms",
                            prep.request_id, prep.internal_id, lease.worker_id, usage.prompt_tokens, num_out,
                            duet_pb2.FinishReason.Name(finish), 1e3 * (time.monotonic() - started))
                yield duet_pb2.GenerateResponse(request_id=prep.request_id, text=text + detok.flush(),
                                                token_ids=ids, finish_reason=finish, usage=usage, logprobs=logprobs)
                return
            raise self._worker_failed(prep, lease, progress, "its stream ended without a finish reason")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.ABORTED and not progress.token_ids and prefill is not None:
                self.directory.report_stream_failure(prefill, e.details() or "")
                self.counts["prefill_failures"] += 1
                raise _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE, e.details() or "remote prefill failed"),
                                      prefill_failed=True) from None
            raise self._map_worker_error(prep, lease, progress, e) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if prefill is not None and prefill.failure is not None and lease.failure is None and not progress.token_ids \
                    and task is not None and not task.cancelling():
                self.counts["prefill_failures"] += 1
                raise _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE, prefill.failure),
                                      prefill_failed=True) from None
            if lease.failure is not None and task is not None and not task.cancelling():
                raise self._worker_failed(prep, lease, progress, lease.failure) from None  # we cancelled the call
            logger.info("request %s (internal %s) cancelled by the client after %d tokens; aborting it on %s",
                        prep.request_id, prep.internal_id, len(progress.token_ids), lease.worker_id)
            self.counts["cancelled"] += 1
            raise
        finally:
            if not call.done():
                call.cancel()  # the worker aborts the request and frees its KV blocks

    def _map_worker_error(self, prep: PreparedRequest, lease: WorkerLease, progress: _Progress,
                          e: grpc.aio.AioRpcError) -> Exception:
        code, details, num_out = e.code(), e.details() or "", len(progress.token_ids)
        if code in _PASS_THROUGH:
            return RequestError(code, details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestError(code, f"deadline exceeded after {num_out} generated tokens")
        if code in _WORKER_GONE:
            return self._worker_failed(prep, lease, progress, f"{code.name}: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and num_out == 0:
            return _RetryElsewhere(RequestError(code, f"worker {lease.worker_id} is overloaded: {details}"))
        logger.warning("request %s: worker %s failed with %s: %s", prep.request_id, lease.worker_id, code.name, details)
        return RequestError(code, f"worker {lease.worker_id}: {details}")

    def _worker_failed(self, prep: PreparedRequest, lease: WorkerLease, progress: _Progress,
                       reason: str) -> Exception:
        self.directory.report_stream_failure(lease, reason)
        num_out = len(progress.token_ids)
        if num_out == 0:
            return _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE,
                                                f"worker {lease.worker_id} is unavailable ({reason})"))
        if self.config.resume_on_worker_failure and progress.resumes < self.config.max_resumes:
            return _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE,
                                                f"worker {lease.worker_id} failed mid-stream ({reason})"))
        self.counts["failed_mid_stream"] += 1
        logger.warning("request %s (internal %s): worker %s failed mid-stream after %d tokens: %s",
                       prep.request_id, prep.internal_id, lease.worker_id, num_out, reason)
        return RequestError(grpc.StatusCode.UNAVAILABLE,
                            f"worker {lease.worker_id} failed mid-stream after {num_out} generated tokens "
                            f"({reason}); the completion is incomplete, retry the request")

    def stats(self) -> dict[str, object]:
        return {"requests": dict(self.counts), "admission": self.admission.stats(),
                "policy_name": self.policy.name, "policy": self.router.counters(), "workers": self.directory.describe(),
                "worker_stream_failures": self.directory.num_stream_failures}


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
