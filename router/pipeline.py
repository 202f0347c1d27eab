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
                 (up to ``max_route_attempts`` workers, for UNAVAILABLE and a full worker queue);
                 after it, the stream ends with the error (text already streamed cannot be undone).

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
from dataclasses import replace

import grpc

from protos.duet.v1 import duet_pb2
from protos.duet.worker.v1 import worker_pb2
from router.admission import AdmissionController, AdmissionRejected
from router.config import RouterConfig
from router.policies import NoWorkersAvailable, RouteRequest, RoutingPolicy
from router.policies.disagg import DisaggRouter, Route
from router.preprocess import PreparedRequest, RequestError, ServedModel, prepare_request
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
_OFFLOAD_CHARS = 16_384  # prompts longer than this are tokenized on a thread, off the event loop


class _RetryElsewhere(Exception):
    """The worker failed before the first token; another worker may serve the request.
    prefill_failed: only the prefill half failed (retry with another prefill worker)."""

    def __init__(self, error: RequestError, prefill_failed: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.prefill_failed = prefill_failed


class Pipeline:
    def __init__(self, config: RouterConfig, model: ServedModel, directory: WorkerDirectory,
                 policy: RoutingPolicy, admission: AdmissionController) -> None:
        self.config = config
        self.model = model
        self.directory = directory
        self.policy = policy
        self.router = DisaggRouter(policy, block_size=config.disagg_block_size,
                                   min_prompt_tokens=config.disagg_min_prompt_tokens)
        self.admission = admission
        self.counts: Counter[str] = Counter()

    async def generate(self, request: duet_pb2.GenerateRequest, *,
                       deadline: float | None = None) -> AsyncIterator[duet_pb2.GenerateResponse]:
        """Stream the completion of ``request``; ``deadline`` is a time.monotonic() instant.
        Raises RequestError (status code + message) for anything the client should see."""
        self.counts["requests"] += 1
        try:
            prep = await self._prepare(request)
            async with self.admission.slot():
                async for response in self._route_and_stream(prep, deadline):
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

    async def _route_and_stream(self, prep: PreparedRequest,
                                deadline: float | None) -> AsyncIterator[duet_pb2.GenerateResponse]:
        route = RouteRequest(prep.internal_id, prep.prompt_token_ids, prep.sampling.max_tokens)
        tried: set[str] = set()  # workers that failed (either half)
        last: RequestError | None = None
        retry_prefill = False
        for _ in range(self.config.max_route_attempts):
            try:
                chosen = self._select(route, tried, retry_prefill)
            except NoWorkersAvailable as e:
                if last is not None:
                    break
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"no healthy worker to serve the request: {e}") from None
            lease = self.directory.begin(chosen.decode_id, route)
            prefill = self.directory.begin(chosen.prefill_id, route) if chosen.prefill_id else None
            try:
                async for response in self._stream(prep, lease, deadline, prefill):
                    yield response
                return
            except _RetryElsewhere as r:
                last, retry_prefill = r.error, r.prefill_failed
                tried.add(chosen.prefill_id if r.prefill_failed else chosen.decode_id)
                logger.warning("request %s: %s; trying another worker", prep.request_id, r.error.message)
            finally:
                self.directory.end(lease)
                if prefill is not None:
                    self.directory.end(prefill)
                self.router.on_request_complete(chosen.decode_id, prep.internal_id)
        assert last is not None
        if retry_prefill:
            last = RequestError(grpc.StatusCode.UNAVAILABLE, last.message)
        raise RequestError(last.code, f"{last.message} (tried {len(tried)} worker(s): {', '.join(sorted(tried))})")

    def _select(self, route: RouteRequest, tried: set[str], require_prefill: bool) -> Route:
        workers = self.directory.snapshot()
        if tried:
            workers = [replace(w, healthy=False) if w.worker_id in tried else w for w in workers]
        return self.router.select(route, workers, require_prefill=require_prefill)

    async def _stream(self, prep: PreparedRequest, lease: WorkerLease, deadline: float | None,
                      prefill: WorkerLease | None = None) -> AsyncIterator[duet_pb2.GenerateResponse]:
        started = time.monotonic()
        timeout = None if deadline is None else max(deadline - started, 0.001)
        request = prep.submit_request()
        if prefill is not None:
            state = prefill.state
            request.remote_prefill.CopyFrom(worker_pb2.RemotePrefill(
                worker_id=prefill.worker_id, endpoint=state.endpoint, incarnation=state.incarnation))
        call = lease.stub.Submit(request, timeout=timeout)
        lease.call = call
        if prefill is not None:  # a prefill worker declared dead cancels the call too (it may hang on it)
            prefill.call = call
        detok = IncrementalDetokenizer(self.model.tokenizer, prep.prompt_token_ids, stop=prep.stop)
        num_out = 0
        try:
            async for delta in call:
                ids, text, stopped = _detokenize(detok, delta.token_ids)
                num_out += len(ids)
                if not stopped and not delta.HasField("finish_reason"):
                    if ids:
                        yield duet_pb2.GenerateResponse(request_id=prep.request_id, text=text, token_ids=ids)
                    continue
                finish = duet_pb2.FINISH_REASON_STOP if stopped else _FINISH.get(delta.finish_reason,
                                                                                 duet_pb2.FINISH_REASON_ABORT)
                usage = duet_pb2.Usage(prompt_tokens=len(prep.prompt_token_ids), completion_tokens=num_out,
                                       cached_prompt_tokens=delta.usage.cached_prompt_tokens)
                self.counts[f"finish_{duet_pb2.FinishReason.Name(finish)[14:].lower()}"] += 1
                logger.info("request %s (internal %s) on %s: %d prompt + %d completion tokens, %s, %.1f ms",
                            prep.request_id, prep.internal_id, lease.worker_id, usage.prompt_tokens, num_out,
                            duet_pb2.FinishReason.Name(finish), 1e3 * (time.monotonic() - started))
                yield duet_pb2.GenerateResponse(request_id=prep.request_id, text=text + detok.flush(),
                                                token_ids=ids, finish_reason=finish, usage=usage)
                return
            raise self._worker_failed(prep, lease, num_out, "its stream ended without a finish reason")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.ABORTED and num_out == 0 and prefill is not None:
                self.directory.report_stream_failure(prefill, e.details() or "")
                self.counts["prefill_failures"] += 1
                raise _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE, e.details() or "remote prefill failed"),
                                      prefill_failed=True) from None
            raise self._map_worker_error(prep, lease, num_out, e) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if prefill is not None and prefill.failure is not None and lease.failure is None and num_out == 0 \
                    and task is not None and not task.cancelling():
                self.counts["prefill_failures"] += 1
                raise _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE, prefill.failure),
                                      prefill_failed=True) from None
            if lease.failure is not None and task is not None and not task.cancelling():
                raise self._worker_failed(prep, lease, num_out, lease.failure) from None  # we cancelled the call
            logger.info("request %s (internal %s) cancelled by the client after %d tokens; aborting it on %s",
                        prep.request_id, prep.internal_id, num_out, lease.worker_id)
            self.counts["cancelled"] += 1
            raise
        finally:
            if not call.done():
                call.cancel()  # the worker aborts the request and frees its KV blocks

    def _map_worker_error(self, prep: PreparedRequest, lease: WorkerLease, num_out: int,
                          e: grpc.aio.AioRpcError) -> Exception:
        code, details = e.code(), e.details() or ""
        if code in _PASS_THROUGH:
            return RequestError(code, details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestError(code, f"deadline exceeded after {num_out} generated tokens")
        if code in _WORKER_GONE:
            return self._worker_failed(prep, lease, num_out, f"{code.name}: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and num_out == 0:
            return _RetryElsewhere(RequestError(code, f"worker {lease.worker_id} is overloaded: {details}"))
        logger.warning("request %s: worker %s failed with %s: %s", prep.request_id, lease.worker_id, code.name, details)
        return RequestError(code, f"worker {lease.worker_id}: {details}")

    def _worker_failed(self, prep: PreparedRequest, lease: WorkerLease, num_out: int, reason: str) -> Exception:
        self.directory.report_stream_failure(lease, reason)
        if num_out == 0:
            return _RetryElsewhere(RequestError(grpc.StatusCode.UNAVAILABLE,
                                                f"worker {lease.worker_id} is unavailable ({reason})"))
        logger.warning("request %s (internal %s): worker %s failed mid-stream after %d tokens: %s",
                       prep.request_id, prep.internal_id, lease.worker_id, num_out, reason)
        return RequestError(grpc.StatusCode.UNAVAILABLE,
                            f"worker {lease.worker_id} failed mid-stream after {num_out} generated tokens "
                            f"({reason}); the completion is incomplete, retry the request")

    def stats(self) -> dict[str, object]:
        return {"requests": dict(self.counts), "admission": self.admission.stats(),
                "policy_name": self.policy.name, "policy": self.router.counters(), "workers": self.directory.describe(),
                "worker_stream_failures": self.directory.num_stream_failures}


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
