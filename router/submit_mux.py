"""SubmitMux: the router's one SubmitStream per worker, carrying every request it sends that worker.

``submit(request, timeout)`` returns a ``SubmitCall`` that behaves as the per-request ``Submit``
call it replaces (router/worker_stream.py iterates it, cancels it, asks whether it is done): it
yields the request's SubmitResponses and ends after its OK SubmitEnd; it raises
``grpc.aio.AioRpcError`` with the status of any other end, or of the stream itself failing (the
worker died, the channel closed); once ``cancel()`` ran (the request's end, or the directory
declaring the worker dead) it raises ``asyncio.CancelledError``, as a cancelled gRPC call does;
at ``timeout`` it raises DEADLINE_EXCEEDED. A cancelled or timed-out request is cancelled at the
worker too (SubmitCancel), which aborts it there and frees its KV blocks.

Why: the worker sends one message per engine step for all of a worker's requests instead of one
per request per step, and the router reads one (workers/server/submit_stream.py), so the per-token
cost of the transport on both sides stops growing with the number of streams.

The stream is opened by the first request and, once it ended, again by the next one. The router
uses a worker's mux only once the worker's load report says it serves SubmitStream
(``LoadReport.submit_stream``, router/workers.py): an older release, during a rolling upgrade, gets
a Submit call per request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamCall(Protocol):
    """What the router needs of a request's worker stream (a SubmitCall or a gRPC Submit call)."""

    def __aiter__(self) -> AsyncIterator[worker_pb2.SubmitResponse]: ...
    def cancel(self) -> bool: ...
    def done(self) -> bool: ...


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


_CANCELLED = object()  # the end of a cancelled call (raises CancelledError where it is read)
_OK = object()


class SubmitCall:
    """One request on a SubmitMux (module docstring)."""

    def __init__(self, mux: SubmitMux, stream: _Stream, stream_id: int, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._mux, self._stream, self._id = mux, stream, stream_id
        self._items: asyncio.Queue[object] = asyncio.Queue()
        self._end: object | None = None  # what ended it, re-raised to a reader that asks again
        self._timer = None if timeout is None else loop.call_later(max(timeout, 0.0), self._expire)

    def __aiter__(self) -> SubmitCall:
        return self

    async def __anext__(self) -> worker_pb2.SubmitResponse:
        item = self._end if self._end is not None and self._items.empty() else await self._items.get()
        if isinstance(item, worker_pb2.SubmitResponse):
            return item
        if item is _OK:
            raise StopAsyncIteration
        if item is _CANCELLED:
            raise asyncio.CancelledError()
        assert isinstance(item, grpc.aio.AioRpcError)
        raise item

    def cancel(self) -> bool:
        """Cancel the request (here and at the worker); False when it had already ended."""
        return self._give_up(_CANCELLED)

    def done(self) -> bool:
        return self._end is not None

    # -- fed by the mux
    def _put(self, response: worker_pb2.SubmitResponse) -> None:
        if self._end is None:
            self._items.put_nowait(response)

    def _finish(self, end: object) -> None:
        if self._end is not None:
            return
        self._end = end
        if self._timer is not None:
            self._timer.cancel()
        self._items.put_nowait(end)

    def _expire(self) -> None:
        self._give_up(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _give_up(self, end: object) -> bool:
        """End it here with ``end`` and cancel it at the worker; False when it had already ended."""
        if self._end is not None:
            return False
        self._finish(end)
        self._mux._cancel(self._stream, self._id)
        return True


class _Stream:
    """One SubmitStream call and the requests on it."""

    def __init__(self) -> None:
        self.outgoing: asyncio.Queue[worker_pb2.SubmitStreamRequest | None] = asyncio.Queue()
        self.calls: dict[int, SubmitCall] = {}
        self.reader: asyncio.Task[None] | None = None  # holds the reading task (the loop keeps only weak refs)

    async def requests(self) -> AsyncIterator[worker_pb2.SubmitStreamRequest]:
        while (msg := await self.outgoing.get()) is not None:
            yield msg


class SubmitMux:
    """The SubmitStream to one worker (``stub``: its channel's Worker stub)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.stub = stub
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    def submit(self, request: worker_pb2.SubmitRequest, timeout: float | None = None) -> SubmitCall:
        """Send ``request`` (module docstring); ``timeout`` in seconds, None = none."""
        stream = self._stream
        if stream is None:
            stream = self._stream = self._open()
        stream_id = next(self._ids)
        call = SubmitCall(self, stream, stream_id, timeout)
        stream.calls[stream_id] = call
        stream.outgoing.put_nowait(worker_pb2.SubmitStreamRequest(
            open=worker_pb2.SubmitOpen(stream_id=stream_id, request=request, timeout_s=timeout or 0.0)))
        return call

    @property
    def open_requests(self) -> int:
        """Requests waiting on the current stream (tests: nothing left behind)."""
        return len(self._stream.calls) if self._stream is not None else 0

    def _open(self) -> _Stream:
        stream = _Stream()
        call = self.stub.SubmitStream(stream.requests())
        stream.reader = asyncio.create_task(self._read(stream, call), name="submit-mux-reader")
        return stream

    def _cancel(self, stream: _Stream, stream_id: int) -> None:
        if stream.calls.pop(stream_id, None) is not None and stream is self._stream:
            stream.outgoing.put_nowait(worker_pb2.SubmitStreamRequest(cancel=worker_pb2.SubmitCancel(stream_id=stream_id)))

    async def _read(self, stream: _Stream, call: grpc.aio.StreamStreamCall) -> None:
        end: object
        try:
            async for batch in call:
                for frame in batch.frames:
                    target = stream.calls.get(frame.stream_id)
                    if target is None:
                        continue  # cancelled here already
                    if frame.WhichOneof("kind") == "response":
                        target._put(frame.response)
                    else:
                        del stream.calls[frame.stream_id]
                        code = _CODES.get(frame.end.code, grpc.StatusCode.UNKNOWN)
                        target._finish(_OK if code is grpc.StatusCode.OK else _error(code, frame.end.details))
            end = _error(grpc.StatusCode.UNAVAILABLE, "the worker ended its request stream (it is stopping)")
        except grpc.aio.AioRpcError as e:
            end = e
        except asyncio.CancelledError:  # the channel closed (or the router is stopping)
            end = _CANCELLED
        finally:
            if self._stream is stream:
                self._stream = None
            stream.outgoing.put_nowait(None)  # ends the request iterator
        for target in stream.calls.values():
            target._finish(end)
        stream.calls.clear()
