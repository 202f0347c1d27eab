"""Holding requests that no worker can take yet: in arrival order, each up to its wait, while the
controller wakes a pool scaled to zero.

A request whose route finds no healthy worker (every worker restarting, or its pool scaled to
zero by the autoscaler) is *held* here, keeping its admission slot (so holding is bounded by the
router's admission limits, ``max_in_flight`` + ``max_queue``):

    order   held requests are served in arrival order: only the oldest may take a worker that joins
            (``Hold.is_head``); it leaves the queue as soon as it has one and the next goes at once.
            A new request never overtakes the held ones.
    wake    the first request held (and again every ``wake_retry_s`` while any is held) asks the
            controller to wake the pools that could take it (``waker``: duet.control.v1.Membership
            /Wake, served by cluster/deploy/membership_service.py). The controller promotes a
            standby replica (in about a second) or starts one (a full start-up).
    bound   a request is held up to ``worker_wait_s``, or -- once the controller said a pool is
            waking -- ``wake_timeout_s`` from when it was held, and never past its own deadline (less a margin, so that it can
            still be answered). Past it, the request fails with UNAVAILABLE (HTTP 503) whose
            message names the wait: how long it was held, for what, and the limit that ended it.
    report  ``stats()``: held now, held in total, timed out, wakes asked and answered; the wake
            time (the time from a request being held on a waking pool to its taking a worker) is
            observed into ``on_wake_s(pools, seconds)`` (the router's ``duet_wake_seconds{pool}``
            histogram, router/request_metrics.py) and logged.

Single event loop, no locks: every method runs on the router's loop.

Example::

    hold = WorkerHold(worker_wait_s=10, wake_timeout_s=60, waker=ask_controller)
    ticket = hold.enter(["colocated", "decode"], deadline)     # may ask the controller to wake a pool
    while not (hold.is_head(ticket) and (worker := pick())):
        if hold.expired(ticket): raise NoWorkersAvailable(hold.why(ticket))
        await hold.wait(ticket)
    hold.leave(ticket, served=True)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 0.25  # a held request gives up this long before its deadline, to answer in time


@dataclass(frozen=True)
class WakeResult:
    """What the controller said to a wake: pools it woke now, pools already waking, and which of the
    woken ones promote a standby replica."""

    woken: tuple[str, ...] = ()
    waking: tuple[str, ...] = ()
    from_standby: tuple[str, ...] = ()

    @property
    def pools(self) -> tuple[str, ...]:
        return self.woken + self.waking


Waker = Callable[[Sequence[str]], Awaitable[WakeResult]]


class HeldTooLong(Exception):
    """A held request's wait ended without a worker; ``wait`` names it (``WorkerHold.why``)."""

    def __init__(self, reason: str, wait: str) -> None:
        super().__init__(reason)
        self.wait = wait


@dataclass(eq=False)
class Ticket:
    """One held request."""

    roles: tuple[str, ...]
    since: float  # time.monotonic() when it was held
    until: float  # when it gives up (worker_wait_s, or wake_timeout_s once a pool wakes; the deadline)
    deadline: float | None
    waking: tuple[str, ...] = ()  # the pools the controller is waking for it
    limit: str = "router.worker_wait_s"  # what bounds ``until``
    event: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerHold:
    """The FIFO of held requests (module docstring)."""

    def __init__(self, *, worker_wait_s: float, wake_timeout_s: float, waker: Waker | None = None,
                 wake_retry_s: float = 5.0, on_wake_s: Callable[[tuple[str, ...], float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_wait_s, self.wake_timeout_s, self.wake_retry_s = worker_wait_s, wake_timeout_s, wake_retry_s
        self._waker, self._on_wake_s, self._clock = waker, on_wake_s, clock
        self._queue: deque[Ticket] = deque()
        self._last_wake = -float("inf")
        self._waking: tuple[str, ...] = ()  # pools the controller last said are waking
        self._wake_task: asyncio.Task | None = None
        self.num_held = 0
        self.num_served = 0
        self.num_timed_out = 0
        self.num_wakes = 0  # Wake calls made
        self.num_woken = 0  # pools the controller woke for us
        self.num_wake_failures = 0

    @property
    def held(self) -> int:
        return len(self._queue)

    def enter(self, roles: Sequence[str], deadline: float | None) -> Ticket:
        """Hold a request that found no worker (asks for a wake when due)."""
        now = self._clock()
        t = Ticket(tuple(roles), now, now + self.worker_wait_s, deadline)
        if self._waking:  # a wake is in progress: this request waits for it too
            self._extend(t, self._waking)
        self._clip(t)
        self._queue.append(t)
        self.num_held += 1
        self._maybe_wake(t.roles)
        return t

    def is_head(self, t: Ticket) -> bool:
        return bool(self._queue) and self._queue[0] is t

    def expired(self, t: Ticket) -> bool:
        return self._clock() >= t.until

    async def wait(self, t: Ticket, poll_s: float = 0.05) -> None:
        """Until the queue moves (this ticket may be the head now) or ``poll_s`` passes (workers
        join through the router's own polling, which does not signal here)."""
        t.event.clear()
        try:
            await asyncio.wait_for(t.event.wait(), poll_s)
        except TimeoutError:
            pass
        if self._queue and self._clock() - self._last_wake >= self.wake_retry_s:
            self._maybe_wake(self._queue[0].roles)

    def leave(self, t: Ticket, *, served: bool) -> None:
        """The request took a worker (served) or gives up; the next one goes at once."""
        if t in self._queue:
            self._queue.remove(t)
        if served:
            self.num_served += 1
            if t.waking:
                waited = self._clock() - t.since
                logger.info("held request served after %.2f s while %s woke", waited, ", ".join(t.waking))
                if self._on_wake_s is not None:
                    self._on_wake_s(t.waking, waited)
        else:
            self.num_timed_out += 1
        if not self._queue:
            self._waking = ()
        if self._queue:
            self._queue[0].event.set()

    def why(self, t: Ticket) -> str:
        """The wait of a request that gave up: what it waited for, how long, and the limit that
        ended it, e.g. "held 60.0 s while pool(s) default woke from zero, until router.wake_timeout_s=60 s"."""
        held = self._clock() - t.since
        what = f" while pool(s) {', '.join(t.waking)} woke from zero" if t.waking else ""
        limit = "the request's deadline" if t.limit == "deadline" else \
            f"{t.limit}={self.wake_timeout_s if t.limit.endswith('wake_timeout_s') else self.worker_wait_s:g} s"
        return f"held {held:.1f} s{what}, until {limit}"

    def stats(self) -> dict[str, int]:
        return {"held": self.held, "held_total": self.num_held, "served_after_hold": self.num_served,
                "hold_timed_out": self.num_timed_out, "wakes": self.num_wakes, "pools_woken": self.num_woken,
                "wake_failures": self.num_wake_failures}

    # ---------------------------------------------------------------- waking
    def _extend(self, t: Ticket, pools: tuple[str, ...]) -> None:
        t.waking = pools
        t.until, t.limit = t.since + self.wake_timeout_s, "router.wake_timeout_s"  # a wake's own bound
        self._clip(t)

    def _clip(self, t: Ticket) -> None:
        if t.deadline is not None and t.deadline - DEADLINE_MARGIN_S < t.until:
            t.until, t.limit = t.deadline - DEADLINE_MARGIN_S, "deadline"

    def _maybe_wake(self, roles: tuple[str, ...]) -> None:
        if self._waker is None or (self._wake_task is not None and not self._wake_task.done()):
            return
        if self._clock() - self._last_wake < self.wake_retry_s:
            return
        self._last_wake = self._clock()
        self._wake_task = asyncio.ensure_future(self._wake(roles))

    async def _wake(self, roles: tuple[str, ...]) -> None:
        self.num_wakes += 1
        try:
            result = await self._waker(roles)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - the controller is down: the requests wait as they would anyway
            self.num_wake_failures += 1
            logger.warning("router: asking the controller to wake a pool failed (%s); held requests wait up to "
                           "router.worker_wait_s", e)
            return
        if result.woken:
            self.num_woken += len(result.woken)
            logger.info("router: woke pool(s) %s%s for %d held request(s)", ", ".join(result.woken),
                        f" (standby promoted: {', '.join(result.from_standby)})" if result.from_standby else "",
                        self.held)
        if result.pools:
            self._waking = result.pools
            for t in self._queue:
                self._extend(t, result.pools)
