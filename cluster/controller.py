"""The cluster controller: which workers exist and where they listen (membership), kept current.

Terms:
    member      a replica that is started and reachable through Ray: (worker_id, endpoint). The
                member list is what the router routes over.
    probe       one ``info()`` call on a replica's actor, every ``poll_interval_s`` (at most one
                outstanding call per replica: a slow actor is never flooded).
    liveness    the controller's concern: is the actor alive and started (Ray's view). *Routing*
                health (gRPC health + load, every 0.2 s) is the router's own concern
                (router/workers.py); the controller does not duplicate it.

Replica states and what moves them:

    starting --start() returned endpoint--> up --Ray: actor died--> down --probe: fresh actor--> starting
        |  ^                                 |                        (Ray restarted it: __init__ ran,
        |  +---- probe: endpoint is None ----+                         start() did not)
        +--start() raised--> failed   (a bad model, a taken port: not retried; see last_error)

A replica is a member exactly while it is ``up``. Every change of the member list (a join, a
leave, a restart's new endpoint) is pushed, as the *full* list, to every subscriber; the router
subscribes with ``RouterHandle.set_members`` and so learns of joins and leaves without a restart.
A restarted replica comes back with a new endpoint (a new port) and a new incarnation; for the
router that is a leave followed by a join.

Current state vs the design: ARCHITECTURE.md has the router learn membership from the controller
over gRPC, so the router can run as its own Kubernetes Deployment. Today the controller and the
router live in one process (``duet serve``) and the push is an in-process call to
``RouterHandle.set_members``. The subscriber interface (a callable taking the full member list) is
the seam where a gRPC membership stream goes later.

A probe that takes longer than ``probe_timeout_s`` is logged (once) but does not remove the
member: an actor that is alive but slow (e.g. busy loading) is Ray's and the router's business,
and removing it on a timeout would make membership flap under load.

Example::

    controller = Controller([pool], poll_interval_s=1.0)
    controller.start()                                  # calls start() on every replica
    controller.wait_ready(timeout=300)                  # all replicas up
    controller.subscribe(router.set_members)            # pushed now and on every change
    ...
    controller.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.pools import Replica, WorkerPool

logger = logging.getLogger(__name__)

Members = list[tuple[str, str]]  # (worker_id, endpoint), sorted by worker id


@dataclass(eq=False)
class _Replica:
    replica: Replica
    state: str = "starting"  # starting | up | down | failed
    endpoint: str | None = None
    incarnation: str | None = None
    call: Any = None  # the one outstanding ObjectRef (start() or info())
    call_kind: str = ""  # "start" | "probe"
    call_since: float = 0.0
    starts: int = 0  # start() calls issued (1 + restarts handled)
    last_error: str = ""
    slow_warned: bool = False


class Controller:
    """Tracks the replicas of ``pools`` on a background thread; thread-safe reads."""

    def __init__(self, pools: list[WorkerPool], *, poll_interval_s: float = 1.0, probe_timeout_s: float = 30.0,
                 start_timeout_s: float = 300.0) -> None:
        self.poll_interval_s = poll_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.start_timeout_s = start_timeout_s
        self._pools = {p.name: p for p in pools}
        self._roles = {r.worker_id: p.section.role for p in pools for r in p.replicas}
        self._replicas = [_Replica(r) for p in pools for r in p.replicas]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._subscribers: list[Callable[[Members], None]] = []
        self._pushed: dict[int, Members] = {}  # subscriber index -> the list it last accepted
        self._push_lock = threading.Lock()  # one push at a time, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_restarts = 0  # replicas found restarted by Ray and started again

    # ---------------------------------------------------------------- public
    def start(self) -> None:
        """Issue start() on every replica and begin polling."""
        assert self._thread is None, "Controller.start() called twice"
        for r in self._replicas:
            self._issue_start(r)
        self._thread = threading.Thread(target=self._run, name="duet-controller", daemon=True)
        self._thread.start()

    def members(self) -> Members:
        with self._lock:
            return self._members_locked()

    def role_of(self, worker_id: str) -> str:
        """The worker's pool role (colocated, prefill or decode)."""
        return self._roles.get(worker_id, "colocated")

    def members_with_roles(self) -> list[tuple[str, str, str]]:
        """``members()`` with each worker's role: what routers are given."""
        return [(w, e, self.role_of(w)) for w, e in self.members()]

    def wait_ready(self, count: int | None = None, timeout: float | None = None) -> bool:
        """Block until ``count`` replicas (default: all) are up; False on timeout, or as soon as
        too many have failed to start for ``count`` to be reachable."""
        count = len(self._replicas) if count is None else count
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while len(self._members_locked()) < count:
                if sum(r.state != "failed" for r in self._replicas) < count:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def wait_for(self, predicate: Callable[[Members], bool], timeout: float) -> bool:
        """Block until ``predicate(members())`` holds (tests and tooling); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self._members_locked()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def subscribe(self, push: Callable[[Members], None]) -> None:
        """Call ``push(full member list)`` now and after every change, on the controller thread
        (the first call on the caller's thread). A push that raises is retried next poll."""
        with self._lock:
            self._subscribers.append(push)
            index = len(self._subscribers) - 1
        self._push(index, push)

    def describe(self) -> list[dict[str, object]]:
        """One dict per replica: pool, role, worker id, state, endpoint, incarnation, starts, last error."""
        with self._lock:
            return [{"pool": r.replica.pool, "role": self.role_of(r.replica.worker_id),
                     "worker_id": r.replica.worker_id, "state": r.state,
                     "endpoint": r.endpoint, "incarnation": r.incarnation, "starts": r.starts,
                     "last_error": r.last_error} for r in self._replicas]

    def stop(self) -> None:
        """Stop polling (before the pool is shut down, so nothing is restarted meanwhile)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self._tick()
            except Exception:  # a bug: log it and keep the pool watched
                logger.exception("controller: poll failed")

    def _tick(self) -> None:
        import ray

        pending = [r for r in self._replicas if r.call is not None]
        done, _ = ray.wait([r.call for r in pending], num_returns=len(pending), timeout=0) if pending else ([], [])
        done_ids = {ref.hex() for ref in done}
        now = time.monotonic()
        for r in pending:
            if r.call.hex() in done_ids:
                self._finish(r)
            else:
                self._check_slow(r, now)
        for r in self._replicas:
            if r.call is None and r.state != "failed":
                self._issue_probe(r)
        for index, push in enumerate(list(self._subscribers)):
            self._push(index, push)

    def _finish(self, r: _Replica) -> None:
        import ray

        kind, call = r.call_kind, r.call
        r.call = None
        wid = r.replica.worker_id
        try:
            result = ray.get(call)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._set(r, "down", None, f"{type(e).__name__}: {_first_line(e)}")
            return
        except ray.exceptions.RayTaskError as e:  # start() itself raised (bad model, port taken, ...)
            self._set(r, "failed", None, f"{kind} failed: {_first_line(e.cause if e.cause else e)}")
            logger.error("controller: %s %s failed (not retried): %s", wid, kind, e)
            return
        if kind == "start":
            self._set(r, "up", result, "")
            return
        endpoint, incarnation = result.get("endpoint"), result.get("incarnation")
        if endpoint is None:  # a fresh actor: Ray restarted it (or it was stopped): start it again
            if r.state in ("up", "down"):
                self.num_restarts += 1
                logger.warning("controller: %s was restarted by Ray (pid %s); starting it again", wid, result.get("pid"))
            self._set(r, "starting", None, "restarted by Ray")
            self._issue_start(r)
        elif r.state != "up" or endpoint != r.endpoint:
            self._set(r, "up", endpoint, "")
        with self._lock:
            r.incarnation = incarnation

    def _check_slow(self, r: _Replica, now: float) -> None:
        limit = self.start_timeout_s if r.call_kind == "start" else self.probe_timeout_s
        if now - r.call_since > limit and not r.slow_warned:
            r.slow_warned = True
            r.last_error = f"{r.call_kind} has not answered for {now - r.call_since:.0f} s"
            logger.warning("controller: %s: %s", r.replica.worker_id, r.last_error)

    def _issue_start(self, r: _Replica) -> None:
        r.call, r.call_kind, r.call_since, r.slow_warned = r.replica.actor.start.remote(), "start", time.monotonic(), False
        r.starts += 1

    def _issue_probe(self, r: _Replica) -> None:
        r.call, r.call_kind, r.call_since, r.slow_warned = r.replica.actor.info.remote(), "probe", time.monotonic(), False

    def _set(self, r: _Replica, state: str, endpoint: str | None, error: str) -> None:
        with self._changed:
            before = (r.state, r.endpoint)
            r.state, r.endpoint = state, endpoint
            if error:
                r.last_error = error
            if before != (state, endpoint):
                logger.info("controller: %s %s -> %s%s%s", r.replica.worker_id, before[0], state,
                            f" at {endpoint}" if endpoint else "", f" ({error})" if error else "")
                self._changed.notify_all()

    def _members_locked(self) -> Members:
        return sorted((r.replica.worker_id, r.endpoint) for r in self._replicas if r.state == "up" and r.endpoint)

    def _push(self, index: int, push: Callable[[Members], None]) -> None:
        with self._push_lock:
            members = self.members()
            if self._pushed.get(index) == members:
                return
            try:
                push(members)
            except Exception:  # noqa: BLE001 - keep the old list marked as pushed, retry next poll
                logger.exception("controller: pushing %d members failed; retrying", len(members))
                return
            self._pushed[index] = members
        logger.info("controller: membership -> %s", ", ".join(f"{w}@{e}" for w, e in members) or "(none)")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
