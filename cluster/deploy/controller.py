"""The cluster controller: which workers exist and where they listen (membership), kept current.

Terms:
    member      a replica that is started and reachable through Ray: (worker_id, endpoint). The
                member list is what the router routes over.
    probe       one ``info()`` call on a replica's actor, every ``poll_interval_s`` (at most one
                outstanding call per replica: a slow actor is never flooded). A start() or
                prepare() that returns ends the wait early: a replica joins as soon as it serves.
    liveness    the controller's concern: is the actor alive and started (Ray's view). *Routing*
                health (gRPC health + load, every ``load_poll_interval_s``) is the router's own concern
                (router/workers.py); the controller does not duplicate it.

Replica states and what moves them:

    starting --start() returned endpoint--> up --Ray: actor died--> down --probe: fresh actor--> starting
        |  ^                                 |                        (Ray restarted it: __init__ ran,
        |  +---- probe: endpoint is None ----+                         start() did not)
        +--start() raised--> failed   (a bad model, a taken port: not retried; see last_error)

Resizing (the autoscaler's Ray actuator, cluster/deploy/ray_actuator.py): ``add(replica)`` tracks and
starts a replica created at runtime. ``retire(worker_id)`` takes one away without dropping a
request: a replica that is not ``up`` (pending, starting, down, failed) has nothing to drain and is
released at once; an ``up`` one goes

    up --retire--> draining --after drain_settle_s: stop(grace, peers)--> (stop returned) --> released
(``peers``: the pool's other up replicas; the draining one migrates its running requests there
first, workers/handoff/drain.py, so it is empty in seconds instead of after its longest generation)

While ``draining`` it is no member (``members()``), but detailed subscribers (the membership
service) still list it, flagged ``draining``, so routers stop routing to it while its streams
finish; ``drain_settle_s`` gives them a moment to hear that before the worker itself refuses new
work (anything routed meanwhile gets UNAVAILABLE before its first token, which the router retries
elsewhere). ``stop(grace)`` waits up to ``grace`` for in-flight requests, aborting only what
outlives it (the router resumes those on another worker); then the pool kills the actors and
frees the placement (``WorkerPool.release``).

Standby (warm spare) replicas: a pool may keep ``set_standby(pool, n)`` replicas started and loaded
but unrouted (the actor's ``prepare()``: weights mapped from the node's snapshot, no KV cache, no
engine, no endpoint; with the pool's ``standby_load: process`` only a warm worker process, whose
promotion loads the weights itself but skips the process start and imports):

    preparing --prepare() returned--> standby --promote()--> starting --start() returned--> up
        (a promotion asked for while preparing starts as soon as the load is done)

A replica adopted as a standby after a controller restart (cluster/deploy/pools.py ``is_standby``)
starts as ``preparing`` (prepare() is idempotent: a loaded one answers at once) and stays a standby
until promoted; a promotion is recorded, so a restart after it starts the replica instead. A
replica retired while ``up`` is recorded draining with the end of its drain (settle + grace); one
adopted so stays ``draining`` (probed once for its endpoint, so routers keep seeing it draining)
and is stopped and released when that time is up.
A standby replica is no member; ``describe()`` and ``pool_states()`` list it (``duet status``, the
router's /metrics). Every poll keeps each pool's standby count at its target: missing ones are
created (``WorkerPool.add_replica``) and prepared, extra ones released (nothing to drain). A standby
replica that dies is released and replaced at once, never restarted in place; one whose
``prepare()`` raised stays ``failed`` (shown, counted against the target, not retried: a bad model
would fail again). ``promote(pool)`` turns the oldest ready standby into a serving replica (the
autoscaler's Ray actuator does this before it creates new replicas); the keeper replaces it.

A replica is a member exactly while it is ``up``. Every change of the member list (a join, a
leave, a restart's new endpoint, a drain) is pushed, as the *full* list, to every subscriber
(``subscribe``; a push that raises is retried on the next poll). The one subscriber ``duet serve``
installs is the membership service (cluster/deploy/membership_service.py, ``duet.control.v1.Membership``),
which subscribes with ``detailed=True`` and streams each list to its watchers over gRPC. Every router
is such a watcher (router/membership.py), also the one ``duet serve`` runs in its own process: it
gets the controller's list once at startup and then follows the same gRPC stream as a router
running as its own Kubernetes Deployment, so there is one path, not an in-process shortcut. A
restarted replica comes back with a new endpoint (a new port) and a new incarnation; for the
router that is a leave followed by a join.

A probe that takes longer than ``probe_timeout_s`` is logged (once) but does not remove the
member: an actor that is alive but slow (e.g. busy loading) is Ray's and the router's business,
and removing it on a timeout would make membership flap under load.

Example::

    controller = Controller([pool], poll_interval_s=1.0)
    controller.start()                                  # calls start() on every replica
    controller.wait_ready(timeout=300)                  # all replicas up
    controller.subscribe(print, detailed=True)          # pushed now and on every change
    serve_membership(controller, "127.0.0.1", 50052)    # what duet serve does: routers watch this
    ...
    controller.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.deploy.pools import Replica, WorkerPool

logger = logging.getLogger(__name__)

Members = list[tuple[str, str]]  # (worker_id, endpoint), sorted by worker id
# (worker_id, endpoint, role, pool, draining): members plus draining replicas, for detailed subscribers
MemberDetails = list[tuple[str, str, str, str, bool]]


@dataclass(eq=False)
class _Replica:
    replica: Replica
    state: str = "starting"  # starting | up | down | failed | draining
    endpoint: str | None = None
    incarnation: str | None = None
    node_id: str | None = None  # the Ray node its (leader) actor last ran on, from the probe
    call: Any = None  # the one outstanding ObjectRef (start() or info())
    call_kind: str = ""  # "start" | "probe"
    call_since: float = 0.0
    starts: int = 0  # start() calls issued (1 + restarts handled)
    last_error: str = ""
    slow_warned: bool = False
    drain_at: float = 0.0  # draining: when to call stop(drain_grace_s)
    drain_grace_s: float = 0.0
    standby: bool = False  # kept loaded and unrouted (preparing | standby) until promoted
    promote_pending: bool = False  # promoted while preparing: start() once prepare() returns
    created_at: float = 0.0  # time.monotonic() of the scale-up decision (add or promote) until it is up
    joined_as: str = "started"  # "started" | "promoted": how its latest join came about
    ready_at: float | None = None  # when it last became up (or standby)


class Controller:
    """Tracks the replicas of ``pools`` on a background thread; thread-safe reads."""

    def __init__(self, pools: list[WorkerPool], *, poll_interval_s: float = 1.0, probe_timeout_s: float = 30.0,
                 start_timeout_s: float = 300.0) -> None:
        self.poll_interval_s = poll_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.start_timeout_s = start_timeout_s
        self._pools = {p.name: p for p in pools}
        self._roles = {r.worker_id: p.section.role for p in pools for r in p.replicas}
        self._pool_of = {r.worker_id: p.name for p in pools for r in p.replicas}
        # a replica adopted as a standby (cluster/deploy/pools.py) stays one: prepared, not started;
        # one adopted draining finishes its drain
        self._replicas = [_adopted(p, r) for p in pools for r in list(p.replicas)]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._subscribers: list[tuple[Callable[[Any], None], bool]] = []  # (push, detailed)
        self._pushed: dict[int, Any] = {}  # subscriber index -> the list it last accepted
        self._push_lock = threading.Lock()  # one push at a time, in order
        self._stop = threading.Event()
        self._kick = threading.Event()  # a start() or prepare() was issued: _wait_poll waits for it
        self._thread: threading.Thread | None = None
        self.num_restarts = 0  # replicas found restarted by Ray and started again
        self.num_drained = 0  # replicas retired after draining
        self._standby_target: dict[str, int] = {p.name: 0 for p in pools}
        self.num_promoted = 0  # standby replicas promoted to serving
        self.num_standby_replaced = 0  # standby replicas that died and were replaced
        # (worker id, "started" | "promoted", seconds from the decision to serving), the latest 100
        self.joins: deque[tuple[str, str, float]] = deque(maxlen=100)

    # ---------------------------------------------------------------- public
    def start(self) -> None:
        """Issue start() on every replica (prepare() on an adopted standby one) and begin polling."""
        assert self._thread is None, "Controller.start() called twice"
        for r in self._replicas:
            r.created_at = time.monotonic()
            if r.state == "draining":  # adopted mid-drain: learn its endpoint (routers keep seeing it draining)
                self._issue_probe(r)
            else:
                (self._issue_prepare if r.standby else self._issue_start)(r)
        self._thread = threading.Thread(target=self._run, name="duet-controller", daemon=True)
        self._thread.start()

    def members(self) -> Members:
        with self._lock:
            return self._members_locked()

    def role_of(self, worker_id: str) -> str:
        """The worker's pool role (colocated, prefill, decode or drafter)."""
        return self._roles.get(worker_id, "colocated")

    def members_with_roles(self) -> list[tuple[str, str, str]]:
        """``members()`` with each worker's role: what routers are given."""
        return [(w, e, self.role_of(w)) for w, e in self.members()]

    def running(self) -> set[str]:
        """Worker ids whose actor answered its start, prepare or probe last (up, standby or draining):
        placed and running, so a ``stop()`` call reaches them (``WorkerPool.shutdown(running=...)``)."""
        with self._lock:
            return {r.replica.worker_id for r in self._replicas if r.state in ("up", "standby", "draining")}

    def member_details(self) -> MemberDetails:
        """Members and draining replicas: (worker_id, endpoint, role, pool, draining), by worker id.
        Drafter replicas are members like workers (role drafter); ``drafter_pool_of`` tells which of
        them a target's requests draft on."""
        with self._lock:
            return self._details_locked()

    def add(self, replica: Replica, *, standby: bool = False) -> None:
        """Track ``replica`` (created at runtime by ``WorkerPool.add_replica``) and start it, or
        with ``standby`` load it as a standby replica (module docstring)."""
        r = _Replica(replica, state="preparing" if standby else "starting", standby=standby,
                     created_at=time.monotonic())
        with self._lock:
            self._roles[replica.worker_id] = self._pools[replica.pool].section.role
            self._pool_of[replica.worker_id] = replica.pool
            self._replicas.append(r)
            (self._issue_prepare if standby else self._issue_start)(r)

    # ---------------------------------------------------------------- standby
    def set_standby(self, pool: str, count: int) -> None:
        """Keep ``count`` standby replicas in ``pool`` (created or released on the next poll)."""
        if count < 0:
            raise ValueError(f"set_standby({pool!r}, {count}): count must be >= 0")
        if pool not in self._pools:
            raise KeyError(pool)
        with self._lock:
            self._standby_target[pool] = count

    def standby_target(self, pool: str) -> int:
        return self._standby_target[pool]

    def promote(self, pool: str) -> str | None:
        """Turn one standby replica of ``pool`` into a serving one: the oldest ready one, else the
        oldest still preparing (it starts when loaded). Returns its worker id, None if there is none."""
        with self._changed:
            spares = [r for r in self._replicas if r.replica.pool == pool and r.standby and not r.promote_pending
                      and r.state in ("standby", "preparing")]
            if not spares:
                return None
            r = min(spares, key=lambda x: (x.state != "standby", x.replica.index))
            r.standby, r.created_at, r.joined_as = False, time.monotonic(), "promoted"
            self.num_promoted += 1
            if r.state == "standby":  # now, even with a probe outstanding (its answer is dropped)
                r.state = "starting"
                self._issue_start(r)
            else:
                r.promote_pending = True  # prepare() is outstanding: start once it returns
            self._changed.notify_all()
        self._pools[pool].mark_serving(r.replica)  # a restarted controller starts it, not prepares it
        logger.info("controller: %s promoted from standby", r.replica.worker_id)
        return r.replica.worker_id

    def _keep_standby(self) -> None:
        """Each pool's standby count to its target (module docstring)."""
        for name, pool in self._pools.items():
            with self._lock:
                target = self._standby_target[name]
                spares = [r for r in self._replicas if r.replica.pool == name and r.standby]
            extra = sorted((r for r in spares if r.state != "failed"), key=lambda r: (r.state == "standby", -r.replica.index))
            for r in extra[: max(0, len(spares) - target)]:
                self._drop_standby(r, "no longer needed")
            for _ in range(target - len(spares)):
                try:
                    replica = pool.add_replica(standby=True)
                except Exception:
                    logger.exception("controller: pool %s: could not create a standby replica", name)
                    break
                self.add(replica, standby=True)

    def _drop_standby(self, r: _Replica, why: str) -> None:
        with self._changed:
            if r not in self._replicas:
                return
            self._replicas.remove(r)
            self._changed.notify_all()
        logger.info("controller: standby %s released (%s)", r.replica.worker_id, why)
        self._pools[r.replica.pool].release(r.replica)

    def retire(self, worker_id: str, *, drain_grace_s: float = 300.0, drain_settle_s: float = 1.0) -> None:
        """Take a replica away without dropping a request (module docstring). Returns at once."""
        with self._changed:
            r = next((x for x in self._replicas if x.replica.worker_id == worker_id), None)
            if r is None or r.state == "draining":
                return
            if r.state == "up":
                logger.info("controller: %s draining (stop in %.1f s, up to %.0f s for its requests)",
                            worker_id, drain_settle_s, drain_grace_s)
                r.state, r.drain_at, r.drain_grace_s = "draining", time.monotonic() + drain_settle_s, drain_grace_s
                self._changed.notify_all()
                draining = r.replica
            else:
                draining = None
                self._replicas.remove(r)
                self._changed.notify_all()
        if draining is not None:  # recorded: a restarted controller finishes the drain (cluster/deploy/pools.py)
            self._pools[draining.pool].mark_draining(draining, time.time() + drain_settle_s + drain_grace_s)
            return
        logger.info("controller: %s retired while %s (nothing to drain)", worker_id, r.state)
        self._pools[r.replica.pool].release(r.replica)

    def wait_ready(self, count: int | None = None, timeout: float | None = None) -> bool:
        """Block until ``count`` replicas (default: all) are up; False on timeout, or as soon as
        too many have failed to start for ``count`` to be reachable."""
        count = sum(not r.standby for r in self._replicas) if count is None else count
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

    def subscribe(self, push: Callable[[Any], None], *, detailed: bool = False) -> None:
        """Call ``push(full member list)`` now and after every change, on the controller thread
        (the first call on the caller's thread). A push that raises is retried next poll.
        detailed: push ``member_details()`` (draining replicas included) instead of ``members()``."""
        with self._lock:
            self._subscribers.append((push, detailed))
            index = len(self._subscribers) - 1
        self._push(index, push, detailed)

    def describe(self) -> list[dict[str, object]]:
        """One dict per replica: pool, role, worker id, state, endpoint, incarnation, the Ray node
        its actor last ran on (``node_id``), starts, last error. A replica ``down`` whose node is
        dead in Ray's view says so in ``last_error`` (an actor error alone does not): "its node
        1a2b3c4d died (...)"; Ray restarts it once a node with room for its bundle exists."""
        with self._lock:
            down = {r.node_id for r in self._replicas if r.state == "down" and r.node_id}
        dead = _dead_nodes(down)
        with self._lock:
            return [{"pool": r.replica.pool, "role": self.role_of(r.replica.worker_id), "index": r.replica.index,
                     "worker_id": r.replica.worker_id, "state": r.state,
                     "endpoint": r.endpoint, "incarnation": r.incarnation, "node_id": r.node_id, "starts": r.starts,
                     "standby": r.standby, "ready_at": r.ready_at,
                     "last_error": (f"its node {r.node_id[:8]} died ({r.last_error})"
                                    if r.state == "down" and r.node_id in dead else r.last_error)}
                    for r in self._replicas]

    def pool_states(self) -> dict[str, dict[str, int]]:
        """Per pool: how many replicas are in each state (up, starting, down, failed, draining,
        preparing, standby; a failed standby counts as ``standby_failed``) and the standby target."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for name in self._pools:
                counts = dict.fromkeys(("up", "starting", "down", "failed", "draining", "preparing", "standby",
                                        "standby_failed"), 0)
                for r in self._replicas:
                    if r.replica.pool == name:
                        counts["standby_failed" if r.standby and r.state == "failed" else r.state] += 1
                counts["standby_target"] = self._standby_target[name]
                out[name] = counts
        return out

    def stop(self) -> None:
        """Stop polling (before the pool is shut down, so nothing is restarted meanwhile)."""
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait_poll()
            if self._stop.is_set():
                return
            try:
                self._tick()
            except Exception:  # a bug: log it and keep the pool watched
                logger.exception("controller: poll failed")

    def _wait_poll(self) -> None:
        """Until the next poll: ``poll_interval_s``, or sooner when a start() or prepare() returns, so a
        replica (a promoted standby above all) joins the member list as soon as it serves instead of
        up to a poll interval later. A start issued meanwhile (``promote``, ``add``: other threads)
        is waited for too (``_kick``)."""
        import ray

        deadline = time.monotonic() + self.poll_interval_s
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            self._kick.clear()
            with self._lock:
                starting = [r.call for r in self._replicas if r.call is not None
                            and r.call_kind in ("start", "prepare")]
            if starting:
                ready, _ = ray.wait(starting, num_returns=1, timeout=min(left, 0.1))
                if ready:
                    return
            else:
                self._kick.wait(left)

    def _tick(self) -> None:
        import ray

        with self._lock:
            replicas = list(self._replicas)
        pending = [r for r in replicas if r.call is not None]
        done, _ = ray.wait([r.call for r in pending], num_returns=len(pending), timeout=0) if pending else ([], [])
        done_ids = {ref.hex() for ref in done}
        now = time.monotonic()
        for r in pending:
            if r.call.hex() in done_ids:
                self._finish(r)
            else:
                self._check_slow(r, now)
        for r in replicas:
            if r.call is not None or r.state == "failed" or r not in self._replicas:
                continue
            if r.state != "draining":
                self._issue_probe(r)
            elif now >= r.drain_at:
                peers = self._migration_peers(r)
                r.call, r.call_kind, r.call_since = r.replica.actor.stop.remote(r.drain_grace_s, peers), "drain", now
        self._keep_standby()
        for index, (push, detailed) in enumerate(list(self._subscribers)):
            self._push(index, push, detailed)

    def _migration_peers(self, r: _Replica) -> list[tuple[str, str]]:
        """(worker id, endpoint) of the up replicas of a draining replica's pool: its running requests
        migrate there before it stops (live migration; none: they finish within the grace). A drafter
        replica has none: its state is a cache, its targets' requests go on without it."""
        if self._roles.get(r.replica.worker_id) == "drafter":
            return []
        with self._lock:
            return [(x.replica.worker_id, x.endpoint) for x in self._replicas
                    if x is not r and x.state == "up" and x.endpoint and x.replica.pool == r.replica.pool]

    def _finish(self, r: _Replica) -> None:
        import ray

        kind, call = r.call_kind, r.call
        r.call = None
        wid = r.replica.worker_id
        if r.state == "draining":
            self._finish_draining(r, kind, call)
            return
        try:
            result = ray.get(call)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            if r.standby:  # nothing runs on it: replace it now rather than wait for Ray's restart
                self.num_standby_replaced += 1
                self._drop_standby(r, f"died: {type(e).__name__}: {_first_line(e)}")
                return
            self._set(r, "down", None, f"{type(e).__name__}: {_first_line(e)}")
            return
        except ray.exceptions.RayTaskError as e:  # start() itself raised (bad model, port taken, ...)
            if _rendezvous_timeout(e):  # a gang rank came back too slowly: the actor is alive, try again
                self._set(r, "down", None, f"{kind} failed: {_first_line(e.cause if e.cause else e)}")
                logger.warning("controller: %s %s timed out waiting for its gang's ranks; retrying: %s", wid, kind,
                               _first_line(e.cause if e.cause else e))
                return
            self._set(r, "failed", None, f"{kind} failed: {_first_line(e.cause if e.cause else e)}")
            logger.error("controller: %s %s failed (not retried): %s", wid, kind, e)
            return
        if r.promote_pending and kind == "prepare":  # promoted while it was loading
            r.promote_pending = False
            self._set(r, "starting", None, "")
            self._issue_start(r)
            return
        if kind == "start":
            self._set(r, "up", result, "")
            return
        if kind == "prepare":
            self._set(r, "standby", None, "")
            return
        endpoint, incarnation = result.get("endpoint"), result.get("incarnation")
        if r.standby and endpoint is None:
            if not result.get("standby"):  # Ray restarted it: load it again
                self._set(r, "preparing", None, "restarted by Ray")
                self._issue_prepare(r)
            with self._lock:
                r.node_id = result.get("node_id", r.node_id)
            return
        if endpoint is None:  # a fresh actor: Ray restarted it (or it was stopped): start it again
            if r.state in ("up", "down"):
                self.num_restarts += 1
                logger.warning("controller: %s was restarted by Ray (pid %s); starting it again", wid, result.get("pid"))
            self._set(r, "starting", None, "restarted by Ray")
            self._issue_start(r)
        elif r.state != "up" or endpoint != r.endpoint:
            self._set(r, "up", endpoint, "")
        with self._lock:
            r.incarnation, r.node_id = incarnation, result.get("node_id", r.node_id)

    def _finish_draining(self, r: _Replica, kind: str, call: Any) -> None:
        """A draining replica's call returned: its stop() (drained: release it), or a probe issued
        before the drain began (ignored, unless the actor died: nothing left to drain)."""
        import ray

        try:
            result = ray.get(call)
            error = ""
        except Exception as e:  # noqa: BLE001 - a dead actor has nothing left to drain
            result, error = None, _first_line(e)
        if kind == "probe" and isinstance(result, dict) and result.get("endpoint") and r.endpoint is None:
            with self._changed:  # adopted mid-drain: listed draining at its endpoint until released
                r.endpoint, r.incarnation = result["endpoint"], result.get("incarnation")
                self._changed.notify_all()
        if kind == "drain" or error:
            self._release(r, f"drained{f' ({error})' if error else ''}")

    def _release(self, r: _Replica, why: str) -> None:
        with self._changed:
            if r not in self._replicas:
                return
            self._replicas.remove(r)
            self.num_drained += 1
            self._changed.notify_all()
        logger.info("controller: %s %s; releasing it", r.replica.worker_id, why)
        self._pools[r.replica.pool].release(r.replica)

    def _check_slow(self, r: _Replica, now: float) -> None:
        if r.call_kind == "drain":
            if now - r.call_since > r.drain_grace_s + self.probe_timeout_s:  # stop() hangs: the actor is stuck
                r.call = None
                self._release(r, f"did not finish draining within {now - r.call_since:.0f} s")
            return
        limit = self.start_timeout_s if r.call_kind in ("start", "prepare") else self.probe_timeout_s
        if now - r.call_since > limit and not r.slow_warned:
            r.slow_warned = True
            r.last_error = f"{r.call_kind} has not answered for {now - r.call_since:.0f} s"
            logger.warning("controller: %s: %s", r.replica.worker_id, r.last_error)

    def _issue_start(self, r: _Replica) -> None:
        r.call, r.call_kind, r.call_since, r.slow_warned = r.replica.actor.start.remote(), "start", time.monotonic(), False
        r.starts += 1
        self._kick.set()

    def _issue_prepare(self, r: _Replica) -> None:
        load = self._pools[r.replica.pool].section.standby_load  # a loaded model, or a warm process only
        r.call, r.call_kind, r.call_since, r.slow_warned = r.replica.actor.prepare.remote(load), "prepare", time.monotonic(), False
        r.starts += 1
        self._kick.set()

    def _issue_probe(self, r: _Replica) -> None:
        r.call, r.call_kind, r.call_since, r.slow_warned = r.replica.actor.info.remote(), "probe", time.monotonic(), False

    def _set(self, r: _Replica, state: str, endpoint: str | None, error: str) -> None:
        with self._changed:
            if r.state == "draining" or r not in self._replicas:
                return  # retired meanwhile (retire() ran between this call's check and here): draining is final
            before = (r.state, r.endpoint)
            r.state, r.endpoint = state, endpoint
            if state in ("up", "standby") and before[0] != state:
                r.ready_at = time.monotonic()
                if state == "up" and before[0] == "starting" and r.created_at:  # a join: how long it took
                    self.joins.append((r.replica.worker_id, r.joined_as, r.ready_at - r.created_at))
                    r.created_at = 0.0
            if error:
                r.last_error = error
            if before != (state, endpoint):
                logger.info("controller: %s %s -> %s%s%s", r.replica.worker_id, before[0], state,
                            f" at {endpoint}" if endpoint else "", f" ({error})" if error else "")
                self._changed.notify_all()

    def _members_locked(self) -> Members:
        return sorted((r.replica.worker_id, r.endpoint) for r in self._replicas if r.state == "up" and r.endpoint)

    def _details_locked(self) -> MemberDetails:
        return sorted((r.replica.worker_id, r.endpoint, self._roles.get(r.replica.worker_id, "colocated"),
                       r.replica.pool, r.state == "draining")
                      for r in self._replicas if r.state in ("up", "draining") and r.endpoint)

    def drafter_pool_of(self, worker_id: str) -> str:
        """The drafter pool the worker's pool drafts on (speculative.drafter_pool; "" = none)."""
        p = self._pools.get(self._pool_of.get(worker_id, ""))
        return (p.section.speculative.drafter_pool or "") if p is not None else ""

    def model_of(self, worker_id: str) -> str:
        """The served model of the worker's pool (its ``model`` key; "" = the default model, and for
        drafter replicas, which draft for whichever pools name them)."""
        p = self._pools.get(self._pool_of.get(worker_id, ""))
        if p is None or p.section.role == "drafter":
            return ""
        return p.section.model or ""

    def router_members(self) -> list[tuple[str, str, str, str, bool, str, str]]:
        """``member_details()`` with each worker's drafter pool and model: the router's MemberInfo entries."""
        return [(*m, self.drafter_pool_of(m[0]), self.model_of(m[0])) for m in self.member_details()]

    def _push(self, index: int, push: Callable[[Any], None], detailed: bool = False) -> None:
        with self._push_lock:
            members = self.member_details() if detailed else self.members()
            if self._pushed.get(index) == members:
                return
            try:
                push(members)
            except Exception:  # keep the old list marked as pushed, retry next poll
                logger.exception("controller: pushing %d members failed; retrying", len(members))
                return
            self._pushed[index] = members
        logger.info("controller: membership -> %s", ", ".join(
            f"{m[0]}@{m[1]}{' (draining)' if detailed and len(m) > 4 and m[4] else ''}" for m in members) or "(none)")


def _adopted(pool: WorkerPool, replica: Replica) -> _Replica:
    """A replica of ``pool`` as the controller tracks it from the start: a standby one preparing, one
    adopted mid-drain draining until the recorded end of its drain's grace (then stopped with no
    grace left: anything still running moves to its peers or is resumed by the router), else starting."""
    if pool.is_standby(replica.worker_id):
        return _Replica(replica, state="preparing", standby=True)
    until = pool.drain_until(replica.worker_id)
    if until is not None:
        return _Replica(replica, state="draining", drain_at=time.monotonic() + max(0.0, until - time.time()))
    return _Replica(replica)


def _dead_nodes(node_ids: set[str]) -> set[str]:
    """Which of ``node_ids`` Ray lists as dead (one GCS call; none when the set is empty)."""
    import ray

    if not node_ids:
        return set()
    return {n["NodeID"] for n in ray.nodes() if n["NodeID"] in node_ids and not n["Alive"]}


def _rendezvous_timeout(e: Exception) -> bool:
    """A start that failed because the gang's other ranks did not join its torch.distributed
    rendezvous in time (a rank restarted by Ray on a healed or new node is still loading): transient,
    unlike a bad model or a taken port, so the replica is retried rather than marked failed."""
    cause = getattr(e, "cause", None) or e
    return type(cause).__name__ in ("DistStoreError", "DistNetworkError") or "clients joined" in str(cause)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
