"""SubmitStream, the worker side: many Submits over one bidirectional stream, their output batched.

The router keeps one SubmitStream per worker (router/submit_mux.py). Each SubmitOpen on it runs
the servicer's own Submit handler (the same checks, status codes and messages as a Submit call)
as a task, with a stand-in for the gRPC context whose ``abort`` ends that request only. What a
request's handler yields goes into the stream's outbox as a frame; the writer sends everything in
the outbox as one SubmitStreamResponse. The engine hands a step's output to every request at once
(one loop callback, workers/engine/loop.py), so all the requests' handlers run before the writer
does and a step leaves as one message instead of one per request; frames that queue while the
previous message is being written leave with the next one (a slow reader gets bigger batches).

A SubmitCancel, and the stream ending (the router went away, or its channel closed), cancel the
requests' handlers: each aborts its request in the engine and frees its KV blocks, as a cancelled
Submit does. ``close()`` (the worker stopping) ends every stream once its requests have ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from protos.duet.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

# Frames per message at most: a backlog (the router reading slowly) leaves as several messages, each
# far below gRPC's 4 MiB default message limit even with top logprobs.
MAX_FRAMES = 256

SubmitHandler = Callable[[worker_pb2.SubmitRequest, Any], AsyncIterator[worker_pb2.SubmitResponse]]


class _Ended(Exception):
    """One request's handler ended with a status (its ``context.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class _RequestContext:
    """What a Submit handler uses of grpc.aio.ServicerContext, for one request on a stream."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        raise _Ended(code, details)

    def time_remaining(self) -> float | None:
        """Seconds left of the request's timeout (None: it has none), as a call's context says."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)


class _Stream:
    """One SubmitStream call: its requests' handler tasks and the frames not yet written."""

    def __init__(self, submit: SubmitHandler) -> None:
        self._submit = submit
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.outbox: list[worker_pb2.SubmitFrame] = []
        self.wake = asyncio.Event()
        self.reading = True

    async def read(self, requests: AsyncIterator[worker_pb2.SubmitStreamRequest]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    self._open(msg.open)
                elif kind == "cancel":
                    task = self.tasks.get(msg.cancel.stream_id)
                    if task is not None:  # an id that already ended: nothing to do
                        task.cancel()
        finally:
            self.reading = False
            self.wake.set()

    def _open(self, msg: worker_pb2.SubmitOpen) -> None:
        stream_id = msg.stream_id
        if stream_id in self.tasks:
            self._end(stream_id, grpc.StatusCode.ALREADY_EXISTS, f"stream_id: {stream_id} is already open on this stream")
            return
        self.tasks[stream_id] = asyncio.create_task(self._run(stream_id, msg.request, _RequestContext(msg.timeout_s)),
                                                    name=f"submit-{msg.request.request_id}")

    async def _run(self, stream_id: int, request: worker_pb2.SubmitRequest, context: _RequestContext) -> None:
        """Run one request's handler; a cancelled one (by the router, or the stream's end) sends no end."""
        code, details = grpc.StatusCode.OK, ""
        try:
            async for response in self._submit(request, context):
                self.outbox.append(worker_pb2.SubmitFrame(stream_id=stream_id, response=response))
                self.wake.set()
        except _Ended as e:
            code, details = e.code, e.details
        except Exception as e:  # what gRPC answers for a handler that raised
            logger.exception("request %s failed on its stream", request.request_id)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e)}: {e}"
        finally:
            self.tasks.pop(stream_id, None)
        self._end(stream_id, code, details)

    def _end(self, stream_id: int, code: grpc.StatusCode, details: str) -> None:
        self.outbox.append(worker_pb2.SubmitFrame(stream_id=stream_id,
                                                  end=worker_pb2.SubmitEnd(code=code.value[0], details=details)))
        self.wake.set()

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()


class SubmitStreams:
    """Serves the SubmitStream calls of one servicer. ``submit``: its Submit handler."""

    def __init__(self, submit: SubmitHandler) -> None:
        self._submit = submit
        self._streams: set[_Stream] = set()
        self._closing = False

    @property
    def open_streams(self) -> int:
        """SubmitStream calls open now (one per router that sent this worker requests)."""
        return len(self._streams)

    async def serve(self, requests: AsyncIterator[worker_pb2.SubmitStreamRequest]
                    ) -> AsyncIterator[worker_pb2.SubmitStreamResponse]:
        """The response stream of one call (the servicer's SubmitStream yields from it)."""
        stream = _Stream(self._submit)
        self._streams.add(stream)
        reader = asyncio.create_task(stream.read(requests), name="submit-stream-reader")
        try:
            while True:
                if stream.outbox:
                    frames, stream.outbox = stream.outbox[:MAX_FRAMES], stream.outbox[MAX_FRAMES:]
                    yield worker_pb2.SubmitStreamResponse(frames=frames)
                elif not stream.tasks and (self._closing or not stream.reading):
                    return
                else:
                    await stream.wake.wait()
                    stream.wake.clear()
        finally:
            self._streams.discard(stream)
            reader.cancel()
            stream.cancel_all()  # each aborts its request in the engine (the handler's finally)

    async def close(self, timeout_s: float) -> None:
        """End every stream once its requests have ended (the worker is stopping), waiting at most
        ``timeout_s`` for their last frames to be written."""
        self._closing = True
        for stream in self._streams:
            stream.wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.01)
