"""Admission control: at most ``max_in_flight`` requests streaming at once, at most ``max_queue``
more waiting (FIFO) for a slot; anything beyond is rejected at once (the server answers
RESOURCE_EXHAUSTED), so an overloaded router sheds load in microseconds instead of letting
latency grow without bound.

A waiting request keeps its place until a slot frees up or its caller goes away (client cancel or
deadline cancels the waiting task; its place is dropped, and a slot handed to it at that very
moment is passed on to the next waiter, never lost).

Example (max_in_flight=2, max_queue=1): requests A, B stream; C waits; D is rejected. When A
finishes, C starts.

Single event loop, no locks: every method runs on the router's loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdmissionRejected(Exception):
    """In-flight slots and the queue are both full (mapped to RESOURCE_EXHAUSTED)."""


class AdmissionController:
    def __init__(self, max_in_flight: int, max_queue: int) -> None:
        assert max_in_flight >= 1 and max_queue >= 0
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.num_admitted = 0
        self.num_queued = 0  # admitted after waiting
        self.num_rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one in-flight slot for the body; raises AdmissionRejected when full."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            self.num_admitted += 1
            return
        if len(self._waiters) >= self.max_queue:
            self.num_rejected += 1
            raise AdmissionRejected(
                f"router overloaded: {self.in_flight} requests in flight (max_in_flight={self.max_in_flight}) "
                f"and {len(self._waiters)} queued (max_queue={self.max_queue}); retry with backoff"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # _release() hands its slot over by resolving the future (in_flight unchanged)
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot arrived as we were cancelled: pass it on
            elif waiter in self._waiters:  # _release() may already have skipped and dropped it
                self._waiters.remove(waiter)
            raise
        self.num_admitted += 1
        self.num_queued += 1

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # slot ownership moves to the waiter
                return
        self.in_flight -= 1
        assert self.in_flight >= 0

    def stats(self) -> dict[str, int]:
        return {"in_flight": self.in_flight, "queued": self.queued, "max_in_flight": self.max_in_flight,
                "max_queue": self.max_queue, "admitted": self.num_admitted,
                "admitted_after_queueing": self.num_queued, "rejected": self.num_rejected}
