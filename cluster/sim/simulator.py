"""Discrete-event simulation of router + pools + autoscaler, on the real policy and autoscaler code.

What is simulated, and what is real:
    arrivals        a Trace (cluster/sim/trace.py), replayed in time order
    routing         the real routing policies (router.policies registry, ``make_policy``), one per
                    pool, called with WorkerState snapshots of the candidate replicas, as the router
                    does; with ``route_candidates = k`` each request sees k replicas sampled at
                    random (power-of-k choices, what a router fleet at 1,000 replicas does to keep
                    routing O(k)); None = every ready replica, exactly the router's view. Load
                    numbers are exact at routing time (the real router's are up to one poll old).
    replicas        cluster/sim/replica.py: a prefill FIFO and a continuously batched decode, step
                    times from a profile's ServiceModel
    scaling         the real control loop (cluster/autoscale/loop.py AutoscaleLoop) with any
                    ScalingPolicy -- the SLO autoscaler or the queue-length baseline -- fed by
                    ``SimMetrics`` (the MetricsProvider a Prometheus one replaces) and applied by
                    ``SimActuator`` (a PoolActuator: replicas start after ``startup_s``), both in
                    cluster/sim/control.py
    scale-down      a removed replica drains (takes no new request, leaves when idle), or, for a
                    pool with a ``MigrationModel``, migrates its running requests to the replicas
                    that stay and leaves in seconds (cluster/sim/migration.py: cost per request =
                    KV bytes / bandwidth + a pause)

Topologies: one ``colocated`` pool (each replica prefills and decodes), or a ``prefill`` pool
feeding a ``decode`` pool (a request's first token comes from its prefill; it then decodes on a
decode replica chosen by the decode pool's policy; KV transfer time is taken as 0). The decoding
pool may speculate (``SimPool.spec``), on a private drafter per replica or on a ``drafter`` pool
of its own size, M:N (cluster/sim/spec.py: rows batched across targets, acceptance per request,
no drafts when the drafter pool is saturated); the autoscaler scales a drafter pool like any other.

Events (a heap of (time, seq, kind, ...); O(log n) per event, O(1) events per request plus one per
autoscaler tick): arrival, prefill done, decode done (lazily invalidated by a per-replica version
when the batch changes), replica ready, tick, and for migrations a source's link free / a sequence
arrived on its target. Requests that find no ready replica wait in the
pool's router queue (FIFO) and count in ``queue_depth``; a request for a pool scaled to zero wakes
it at once (``scale_to(pool, 1)``, as the router's Wake does: cluster/deploy/wake.py), and again
at a tick while requests wait there and the pool is at zero (the router's wake retry).

Replica-hours integrate every replica that exists (starting, ready or draining) over time.
``SimResult.migration`` counts migrations, bytes moved and how long each removed replica took to
leave.

Example::

    sim = Simulation(trace, [SimPool("main", "colocated", svc, replicas=4)], slo=SLOTargets(0.5, 0.05))
    res = sim.run()                 # fixed size: no scaling policy
    res.attainment, res.replica_hours
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.autoscale.loop import AutoscaleLoop, ScalingPolicy
from cluster.autoscale.profile import SLOTargets
from cluster.sim.control import SimActuator, SimMetrics, p90
from cluster.sim.migration import MigrationStats, Migrator
from cluster.sim.pool import Bucket, PoolState, SimPool
from cluster.sim.replica import SimReplica
from cluster.sim.drafting import Drafting
from cluster.sim.spec import SpecCounters
from cluster.sim.trace import Trace
from router.policies import RouteRequest, WorkerState, make_policy

logger = logging.getLogger(__name__)

ARRIVAL, PREFILL_DONE, DECODE_DONE, READY, TICK, MIGRATE_NEXT, MIGRATE_DONE = range(7)


class SimulationError(RuntimeError):
    """The simulation cannot finish (e.g. no replica will ever serve queued requests)."""


@dataclass
class SimResult:
    ttft: np.ndarray  # [N] seconds
    tpot: np.ndarray  # [N] seconds, NaN for 1-token outputs
    met: np.ndarray  # [N] bool: TTFT and TPOT both within the SLO
    replica_seconds: dict[str, float]
    timeline: dict[str, list[float]]
    events: int
    wall_s: float
    cpu_s: float  # process CPU time of the run (the wall time on a shared machine is not the cost)
    end_s: float
    migration: MigrationStats = field(default_factory=MigrationStats)
    standby_seconds: dict[str, float] = field(default_factory=dict)  # standby replica-seconds x standby_cost
    promotions: dict[str, int] = field(default_factory=dict)  # standby replicas promoted, per pool
    spec: dict[str, SpecCounters] = field(default_factory=dict)  # speculating pool -> its counters

    @property
    def attainment(self) -> float:
        return float(self.met.mean()) if len(self.met) else math.nan

    @property
    def replica_hours(self) -> float:
        """Serving replicas (starting, ready, draining) plus standby replicas at their cost."""
        return (sum(self.replica_seconds.values()) + sum(self.standby_seconds.values())) / 3600.0

    @property
    def standby_hours(self) -> float:
        """The standby replicas' share of ``replica_hours`` (already weighted by their cost)."""
        return sum(self.standby_seconds.values()) / 3600.0

    def p90(self, which: str) -> float:
        x = getattr(self, which)
        x = x[~np.isnan(x)]
        return float(np.percentile(x, 90)) if len(x) else math.nan


class Simulation:
    def __init__(self, trace: Trace, pools: list[SimPool], *, slo: SLOTargets,
                 scaling: ScalingPolicy | None = None, tick_s: float = 10.0, window_buckets: int = 30,
                 latency_buckets: int = 3, route_candidates: int | None = None, max_total_replicas: int | None = None,
                 seed: int = 0, max_drain_s: float = 6 * 3600.0) -> None:
        roles = sorted(p.role for p in pools if p.role != "drafter")
        if roles not in (["colocated"], ["decode", "prefill"]):
            raise ValueError(f"pools: roles {roles}: simulate one colocated pool, or one prefill + one decode pool "
                             "(and drafter pools)")
        drafters = {p.name for p in pools if p.role == "drafter"}
        named = {p.spec.drafter_pool for p in pools if p.spec is not None and p.spec.drafter_pool is not None}
        if drafters != named:
            raise ValueError(f"pools: drafter pools {sorted(drafters)} must be exactly those the speculating pools "
                             f"name in spec.drafter_pool ({sorted(named)})")
        self.trace, self.slo, self.tick_s = trace, slo, tick_s
        self.window_buckets, self.latency_buckets = window_buckets, latency_buckets
        self.k, self.max_total, self.max_drain_s = route_candidates, max_total_replicas, max_drain_s
        self.rng = random.Random(seed)
        self.pools = {p.name: PoolState(p, make_policy(p.policy, **p.policy_options)) for p in pools}
        self.drafting = Drafting(self.pools, len(trace), seed, route_candidates)
        self.entry = next(p for p in self.pools.values() if p.spec.role in ("colocated", "prefill"))
        self.decode = next((p for p in self.pools.values() if p.spec.role == "decode"), None)
        n = len(trace)
        self.first = [math.nan] * n
        self.done = [math.nan] * n
        self.prompt = trace.prompt.tolist()
        self.output = trace.output.tolist()
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.completed = 0
        self.actuator = SimActuator(self)
        self.migrator = Migrator(self)
        self.loop = AutoscaleLoop(scaling, SimMetrics(self), self.actuator, interval_s=tick_s,
                                  clock=lambda: self.now) if scaling is not None else None
        self.timeline: dict[str, list[float]] = {"t": [], "arrival_rps": [], "ttft_p90": [], "tpot_p90": []}
        for p in self.pools.values():
            for key in ("ready", "alive", "desired", "standby"):
                self.timeline[f"{p.name}.{key}"] = []

    # ------------------------------------------------------------------ driver
    def run(self) -> SimResult:
        wall, cpu = time.perf_counter(), time.process_time()
        for p in self.pools.values():
            for _ in range(p.spec.replicas):
                r = self.actuator.add_replica(p, 0.0)
                self._ready(r)  # the initial replicas are up at t = 0
            self.actuator.keep_standby(p)
            for r in p.spares:  # so are the initial standby replicas
                self._ready(r)
        if len(self.trace):
            self._push(float(self.trace.t[0]), ARRIVAL, 0)
        self._push(self.tick_s, TICK, None)
        events = self._loop()
        for p in self.pools.values():
            p.count_alive(self.now, 0)
            p.count_spares(self.now)
            self._take_spec(p)
        ttft = np.asarray(self.first) - self.trace.t
        out = self.trace.output
        tpot = np.where(out > 1, (np.asarray(self.done) - np.asarray(self.first)) / np.maximum(out - 1, 1), np.nan)
        met = np.ones(len(ttft), dtype=bool)
        if self.slo.ttft_p90_s is not None:
            met &= ttft <= self.slo.ttft_p90_s
        if self.slo.tpot_p90_s is not None:
            met &= np.isnan(tpot) | (tpot <= self.slo.tpot_p90_s)
        return SimResult(ttft, tpot, met, {p.name: p.replica_seconds for p in self.pools.values()},
                         self.timeline, events, time.perf_counter() - wall, time.process_time() - cpu, self.now,
                         self.migrator.stats, {p.name: p.standby_seconds * p.spec.standby_cost
                                               for p in self.pools.values()},
                         {p.name: p.promotions for p in self.pools.values()},
                         {p.name: p.spec_total for p in self.pools.values() if p.spec.spec})

    def _push(self, t: float, kind: int, a: Any, b: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, a, b))

    def _loop(self) -> int:
        n, events, heap = len(self.trace), 0, self.heap
        t_arr = self.trace.t.tolist()
        deadline = (t_arr[-1] if n else 0.0) + self.max_drain_s
        while heap:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            events += 1
            if kind == DECODE_DONE:
                if b == a.version:
                    self._decode_done(a)
            elif kind == ARRIVAL:
                if a + 1 < n:
                    self._push(t_arr[a + 1], ARRIVAL, a + 1)
                self._arrive(a)
            elif kind == PREFILL_DONE:
                self._prefill_done(a)
            elif kind == READY:
                self._ready(a)
            elif kind == MIGRATE_DONE:
                self.migrator.arrive(*a)
            elif kind == MIGRATE_NEXT:
                self.migrator.step(a)
            else:
                if self.completed == n:
                    break
                if t > deadline:
                    raise SimulationError(f"{n - self.completed} requests still unfinished {self.max_drain_s:.0f} s "
                                          "after the last arrival (no replica serves them: check min_replicas)")
                self._tick()
                self._push(t + self.tick_s, TICK, None)
        return events

    # ------------------------------------------------------------------ request path
    def _arrive(self, i: int) -> None:
        b = self.entry.bucket
        b.arrivals += 1
        b.prompt += self.prompt[i]
        b.output += self.output[i]
        self.send_entry(self.entry, i)

    def _route(self, pool: PoolState, i: int) -> SimReplica | None:
        if not pool.routable:
            pool.queue.append(i)
            if pool.desired == 0:  # scaled to zero: the router holds the request and wakes the pool
                self.actuator.scale_to(pool.name, 1)
                pool.wakes += 1
            return None
        return self.pick(pool, pool.routable, i)

    def pick(self, pool: PoolState, cands: list[SimReplica], i: int) -> SimReplica:
        """The pool's routing policy's choice among ``cands`` (k of them sampled, with route_candidates)."""
        if self.k is not None and len(cands) > self.k:
            cands = self.rng.sample(cands, self.k)
        now = self.now
        states = [WorkerState(r.worker_id, healthy=True, num_running=r.num_running(), num_waiting=r.num_waiting(),
                              outstanding_tokens=r.outstanding_tokens(now), kv_block_size=1, kv_blocks_total=0,
                              kv_blocks_used=r.held_tokens(now), in_flight_requests=r.in_flight) for r in cands]
        wid = pool.policy.select(RouteRequest(str(i), range(i, i + self.prompt[i]), self.output[i]), states)
        return pool.replicas[wid]

    def send_entry(self, pool: PoolState, i: int) -> None:
        r = self._route(pool, i)
        if r is not None:
            t = r.enqueue_prefill(i, self.prompt[i], self.now)
            if t is not None:
                self._push(t, PREFILL_DONE, r)

    def _send_decode(self, pool: PoolState, i: int) -> None:
        r = self._route(pool, i)
        if r is not None:
            rate, k = self.drafting.join(r, i, self.now)
            r.join_decode(i, self.output[i] - 1, self.prompt[i], self.now, rate=rate, k=k)
            self.drafting.refresh(r, self.now)
            self.resched(r)

    def _prefill_done(self, r: SimReplica) -> None:
        now = self.now
        i, t_next = r.finish_prefill(now)
        if t_next is not None:
            self._push(t_next, PREFILL_DONE, r)
        self.first[i] = now
        pool = self.pools[r.pool]
        pool.bucket.ttft.append(now - float(self.trace.t[i]))
        if self.output[i] <= 1:
            self._finish(pool, r, i)
            r.release()
        elif pool.colocated:
            rate, k = self.drafting.join(r, i, now)
            r.join_decode(i, self.output[i] - 1, self.prompt[i], now, counted=False, rate=rate, k=k)
            self.drafting.refresh(r, now)
            if r.state == "draining" and pool.spec.migration is not None:
                self.migrator.start(r)
        else:
            r.release()
            pool.policy.on_request_complete(r.worker_id, str(i))
            d = self.decode
            assert d is not None
            d.bucket.arrivals += 1
            d.bucket.prompt += self.prompt[i]
            d.bucket.output += self.output[i]
            self._send_decode(d, i)
        self.resched(r)
        self.maybe_leave(r)

    def _decode_done(self, r: SimReplica) -> None:
        pool = self.pools[r.pool]
        for i in r.finish_decodes(self.now):
            self._finish(pool, r, i)
            pool.bucket.tpot.append((self.now - self.first[i]) / (self.output[i] - 1))
            d = self.drafting.leave(i)
            if d is not None:
                self.maybe_leave(d)
        self.drafting.refresh(r, self.now)
        self.resched(r)
        self.maybe_leave(r)

    def _finish(self, pool: PoolState, r: SimReplica, i: int) -> None:
        self.done[i] = self.now
        self.completed += 1
        pool.policy.on_request_complete(r.worker_id, str(i))

    def resched(self, r: SimReplica) -> None:
        t = r.next_decode_done(self.now)
        if t is not None:
            self._push(t, DECODE_DONE, r, r.version)

    # ------------------------------------------------------------------ replicas
    def _ready(self, r: SimReplica) -> None:
        if r.state == "preparing":  # a standby replica finished loading
            self.pools[r.pool].count_spares(self.now)
            r.state = "standby"
            return
        if r.state != "starting":
            return  # cancelled while starting (or a spare dropped while loading)
        r.state, r.ready_at = "ready", self.now
        pool = self.pools[r.pool]
        pool.routable.append(r)
        while pool.queue:
            i = pool.queue.popleft()
            (self._send_decode if pool.spec.role == "decode" else self.send_entry)(pool, i)

    def maybe_leave(self, r: SimReplica) -> None:
        if r.state == "draining" and r.idle() and not self.migrator.busy(r):
            self.actuator.remove(self.pools[r.pool], r)

    def schedule_ready(self, r: SimReplica, after_s: float | None = None) -> None:
        """A replica just asked for is ready after ``after_s`` (default its pool's start-up time)."""
        self._push(self.now + (self.pools[r.pool].spec.startup_s if after_s is None else after_s), READY, r)

    def drain(self, r: SimReplica) -> None:
        """``r`` was just taken out of routing: it migrates its requests away, or drains."""
        if self.pools[r.pool].spec.migration is not None:
            self.migrator.start(r)
        self.maybe_leave(r)

    def push_migration(self, t: float, source: SimReplica, arrival: tuple[SimReplica, int, float, int]) -> None:
        self._push(t, MIGRATE_DONE, arrival)  # arrives before the source's link moves the next one
        self._push(t, MIGRATE_NEXT, source)

    # ------------------------------------------------------------------ ticks
    def _take_spec(self, p: PoolState) -> SpecCounters | None:
        """A speculating pool's counters since the last call (every replica's clock brought to now)."""
        if p.spec.spec is None:
            return None
        for r in p.replicas.values():
            r.sync(self.now)
        got, p.spec_counters = p.spec_counters, SpecCounters()
        for r in p.replicas.values():
            r.counters = p.spec_counters
        p.spec_total.merge(got)
        return got

    def _tick(self) -> None:
        for p in self.pools.values():
            p.bucket.queued = len(p.queue) + sum(r.num_waiting() for r in p.routable)
            p.bucket.running = sum(r.num_running() for r in p.replicas.values())
            if p.spec.role == "drafter":
                p.bucket.rows = sum(r.in_flight for r in p.replicas.values())
                p.bucket.unserved = len(self.drafting.unserved.get(p.name, ()))
            p.bucket.spec = self._take_spec(p)
            p.history.append(p.bucket)
            if len(p.history) > self.window_buckets:
                p.history.popleft()
            p.bucket = Bucket()
        if self.loop is not None:
            self.loop.step(self.now)
        for p in self.pools.values():
            if p.queue and p.desired == 0:  # held requests ask again (the router's wake retry)
                self.actuator.scale_to(p.name, 1)
                p.wakes += 1
            if p.spec.rebalance:
                self.migrator.rebalance(p)
        self._record()

    def _record(self) -> None:
        tl, e = self.timeline, self.entry.history[-1]
        tl["t"].append(self.now)
        tl["arrival_rps"].append(e.arrivals / self.tick_s)
        tl["ttft_p90"].append(p90(e.ttft))
        last = (self.decode or self.entry).history[-1]
        tl["tpot_p90"].append(p90(last.tpot))
        for p in self.pools.values():
            tl[f"{p.name}.ready"].append(len(p.routable))
            tl[f"{p.name}.alive"].append(p.alive)
            tl[f"{p.name}.desired"].append(p.desired)
            tl[f"{p.name}.standby"].append(len(p.spares))
