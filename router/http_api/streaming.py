"""Server-sent events and client disconnects for the HTTP API.

A client that goes away must cancel its request, as a gRPC cancel does: the request's task is
cancelled, the CancelledError runs through ``Pipeline.generate``, whose ``finally`` cancels the
worker call, and the worker aborts the request and frees its KV blocks. Starlette's own
StreamingResponse notices a disconnect only when a write fails (ASGI 2.4 servers) and then leaves
the body generator un-closed until garbage collection, so both the streaming and the whole-response
paths here race the work against the ASGI ``http.disconnect`` message instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the response was complete (its request was cancelled)."""


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelled (ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)


class EventStreamResponse(Response):
    """A ``text/event-stream`` response from an async iterator of encoded events; the iterator is
    cancelled and closed as soon as the client disconnects (and closed in every other case)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream())
        except (ClientGone, OSError):
            pass  # the client left: its request was cancelled with the stream task
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
