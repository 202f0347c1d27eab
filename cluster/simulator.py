"""Discrete-event simulation of router + pools + autoscaler, on the real policy and autoscaler code.

What is simulated, and what is real:
    arrivals        a Trace (cluster/sim_trace.py), replayed in time order
    routing         the real routing policies (router.policies registry, ``make_policy``), one per
                    pool, called with WorkerState snapshots of the candidate replicas, as the router
                    does; with ``route_candidates = k`` each request sees k replicas sampled at
                    random (power-of-k choices, what a router fleet at 1,000 replicas does to keep
                    routing O(k)); None = every ready replica, exactly the router's view. Load
                    numbers are exact at routing time (the real router's are up to one poll old).
    replicas        cluster/sim_replica.py: a prefill FIFO and a continuously batched decode, step
                    times from a profile's ServiceModel
    scaling         the real control loop (cluster/autoscale_loop.py AutoscaleLoop) with any
                    ScalingPolicy -- the SLO autoscaler or the queue-length baseline -- fed by
                    ``SimMetrics`` (the MetricsProvider a Prometheus one replaces) and applied by
                    ``SimActuator`` (a PoolActuator: replicas start after ``startup_s``, scale-down
                    drains: a draining replica takes no new request and leaves when idle)

Topologies: one ``colocated`` pool (each replica prefills and decodes), or a ``prefill`` pool
feeding a ``decode`` pool (a request's first token comes from its prefill; it then decodes on a
decode replica chosen by the decode pool's policy; KV transfer time is taken as 0).

Events (a heap of (time, seq, kind, ...); O(log n) per event, O(1) events per request plus one per
autoscaler tick): arrival, prefill done, decode done (lazily invalidated by a per-replica version
when the batch changes), replica ready, tick. Requests that find no ready replica wait in the
pool's router queue (FIFO) and count in ``queue_depth``.

Replica-hours integrate every replica that exists (starting, ready or draining) over time.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.actuator import PoolStatus
from cluster.autoscale_loop import AutoscaleLoop, ScalingPolicy
from cluster.autoscaler import PoolMetrics
from cluster.profile import ServiceModel, SLOTargets
from cluster.sim_replica import SimReplica
from cluster.sim_trace import Trace
from router.policies import RouteRequest, RoutingPolicy, WorkerState, make_policy

logger = logging.getLogger(__name__)

ARRIVAL, PREFILL_DONE, DECODE_DONE, READY, TICK = range(5)


class SimulationError(RuntimeError):
    """The simulation cannot finish (e.g. no replica will ever serve queued requests)."""


@dataclass(frozen=True)
class SimPool:
    """One simulated pool. role: colocated | prefill | decode."""

    name: str
    role: str
    service: ServiceModel
    replicas: int = 1
    startup_s: float = 60.0
    policy: str = "least_loaded"
    policy_options: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass
class _Bucket:
    arrivals: int = 0
    prompt: int = 0
    output: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    queued: float = 0.0
    running: float = 0.0


class _Pool:
    def __init__(self, spec: SimPool, policy: RoutingPolicy) -> None:
        self.spec, self.name, self.policy = spec, spec.name, policy
        self.colocated = spec.role == "colocated"
        self.replicas: dict[str, SimReplica] = {}
        self.routable: list[SimReplica] = []
        self.queue: deque[int] = deque()  # requests waiting at the router for any ready replica
        self.pending = 0
        self.desired = spec.replicas
        self.next_index = 0
        self.alive = 0  # starting + ready + draining
        self.alive_since = 0.0
        self.replica_seconds = 0.0
        self.bucket = _Bucket()
        self.history: deque[_Bucket] = deque()

    def count_alive(self, now: float, delta: int) -> None:
        self.replica_seconds += self.alive * (now - self.alive_since)
        self.alive, self.alive_since = self.alive + delta, now


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

    @property
    def attainment(self) -> float:
        return float(self.met.mean()) if len(self.met) else math.nan

    @property
    def replica_hours(self) -> float:
        return sum(self.replica_seconds.values()) / 3600.0

    def p90(self, which: str) -> float:
        x = getattr(self, which)
        x = x[~np.isnan(x)]
        return float(np.percentile(x, 90)) if len(x) else math.nan


class Simulation:
    def __init__(self, trace: Trace, pools: list[SimPool], *, slo: SLOTargets,
                 scaling: ScalingPolicy | None = None, tick_s: float = 10.0, window_buckets: int = 30,
                 latency_buckets: int = 3, route_candidates: int | None = None, max_total_replicas: int | None = None,
                 seed: int = 0, max_drain_s: float = 6 * 3600.0) -> None:
        roles = sorted(p.role for p in pools)
        if roles not in (["colocated"], ["decode", "prefill"]):
            raise ValueError(f"pools: roles {roles}: simulate one colocated pool, or one prefill + one decode pool")
        self.trace, self.slo, self.tick_s = trace, slo, tick_s
        self.window_buckets, self.latency_buckets = window_buckets, latency_buckets
        self.k, self.max_total, self.max_drain_s = route_candidates, max_total_replicas, max_drain_s
        self.rng = random.Random(seed)
        self.pools = {p.name: _Pool(p, make_policy(p.policy, **p.policy_options)) for p in pools}
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
        self.loop = AutoscaleLoop(scaling, SimMetrics(self), self.actuator, interval_s=tick_s,
                                  clock=lambda: self.now) if scaling is not None else None
        self.timeline: dict[str, list[float]] = {"t": [], "arrival_rps": [], "ttft_p90": [], "tpot_p90": []}
        for p in self.pools.values():
            for key in ("ready", "alive", "desired"):
                self.timeline[f"{p.name}.{key}"] = []

    # ------------------------------------------------------------------ driver
    def run(self) -> SimResult:
        wall, cpu = time.perf_counter(), time.process_time()
        for p in self.pools.values():
            for _ in range(p.spec.replicas):
                r = self.actuator.add_replica(p, 0.0)
                self._ready(r)  # the initial replicas are up at t = 0
        if len(self.trace):
            self._push(float(self.trace.t[0]), ARRIVAL, 0)
        self._push(self.tick_s, TICK, None)
        events = self._loop()
        for p in self.pools.values():
            p.count_alive(self.now, 0)
        ttft = np.asarray(self.first) - self.trace.t
        out = self.trace.output
        tpot = np.where(out > 1, (np.asarray(self.done) - np.asarray(self.first)) / np.maximum(out - 1, 1), np.nan)
        met = np.ones(len(ttft), dtype=bool)
        if self.slo.ttft_p90_s is not None:
            met &= ttft <= self.slo.ttft_p90_s
        if self.slo.tpot_p90_s is not None:
            met &= np.isnan(tpot) | (tpot <= self.slo.tpot_p90_s)
        return SimResult(ttft, tpot, met, {p.name: p.replica_seconds for p in self.pools.values()},
                         self.timeline, events, time.perf_counter() - wall, time.process_time() - cpu, self.now)

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
        self._send_entry(self.entry, i)

    def _route(self, pool: _Pool, i: int) -> SimReplica | None:
        cands = pool.routable
        if not cands:
            pool.queue.append(i)
            return None
        if self.k is not None and len(cands) > self.k:
            cands = self.rng.sample(cands, self.k)
        now = self.now
        states = [WorkerState(r.worker_id, healthy=True, num_running=r.num_running(), num_waiting=r.num_waiting(),
                              outstanding_tokens=r.outstanding_tokens(now), kv_block_size=1, kv_blocks_total=0,
                              kv_blocks_used=r.held_tokens(now), in_flight_requests=r.in_flight) for r in cands]
        wid = pool.policy.select(RouteRequest(str(i), range(i, i + self.prompt[i]), self.output[i]), states)
        return pool.replicas[wid]

    def _send_entry(self, pool: _Pool, i: int) -> None:
        r = self._route(pool, i)
        if r is not None:
            t = r.enqueue_prefill(i, self.prompt[i], self.now)
            if t is not None:
                self._push(t, PREFILL_DONE, r)

    def _send_decode(self, pool: _Pool, i: int) -> None:
        r = self._route(pool, i)
        if r is not None:
            r.join_decode(i, self.output[i] - 1, self.prompt[i], self.now)
            self._resched(r)

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
            r.join_decode(i, self.output[i] - 1, self.prompt[i], now, counted=False)
        else:
            r.release()
            pool.policy.on_request_complete(r.worker_id, str(i))
            d = self.decode
            assert d is not None
            d.bucket.arrivals += 1
            d.bucket.prompt += self.prompt[i]
            d.bucket.output += self.output[i]
            self._send_decode(d, i)
        self._resched(r)
        self._maybe_leave(r)

    def _decode_done(self, r: SimReplica) -> None:
        pool = self.pools[r.pool]
        for i in r.finish_decodes(self.now):
            self._finish(pool, r, i)
            pool.bucket.tpot.append((self.now - self.first[i]) / (self.output[i] - 1))
        self._resched(r)
        self._maybe_leave(r)

    def _finish(self, pool: _Pool, r: SimReplica, i: int) -> None:
        self.done[i] = self.now
        self.completed += 1
        pool.policy.on_request_complete(r.worker_id, str(i))

    def _resched(self, r: SimReplica) -> None:
        t = r.next_decode_done(self.now)
        if t is not None:
            self._push(t, DECODE_DONE, r, r.version)

    # ------------------------------------------------------------------ replicas
    def _ready(self, r: SimReplica) -> None:
        if r.state != "starting":
            return  # cancelled while starting
        r.state, r.ready_at = "ready", self.now
        pool = self.pools[r.pool]
        pool.routable.append(r)
        while pool.queue:
            i = pool.queue.popleft()
            (self._send_decode if pool.spec.role == "decode" else self._send_entry)(pool, i)

    def _maybe_leave(self, r: SimReplica) -> None:
        if r.state == "draining" and r.idle():
            self.actuator.remove(self.pools[r.pool], r)

    # ------------------------------------------------------------------ ticks
    def _tick(self) -> None:
        for p in self.pools.values():
            p.bucket.queued = len(p.queue) + sum(r.num_waiting() for r in p.routable)
            p.bucket.running = sum(r.num_running() for r in p.replicas.values())
            p.history.append(p.bucket)
            if len(p.history) > self.window_buckets:
                p.history.popleft()
            p.bucket = _Bucket()
        if self.loop is not None:
            self.loop.step(self.now)
        self._record()

    def _record(self) -> None:
        tl, e = self.timeline, self.entry.history[-1]
        tl["t"].append(self.now)
        tl["arrival_rps"].append(e.arrivals / self.tick_s)
        tl["ttft_p90"].append(_p90(e.ttft))
        last = (self.decode or self.entry).history[-1]
        tl["tpot_p90"].append(_p90(last.tpot))
        for p in self.pools.values():
            tl[f"{p.name}.ready"].append(len(p.routable))
            tl[f"{p.name}.alive"].append(p.alive)
            tl[f"{p.name}.desired"].append(p.desired)


def _p90(xs: list[float]) -> float:
    """The 90th percentile, linearly interpolated (numpy's default), without numpy's overhead on
    the short per-bucket lists this is called on every tick."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    pos = 0.9 * (len(ys) - 1)
    lo = int(pos)
    return ys[lo] + (ys[min(lo + 1, len(ys) - 1)] - ys[lo]) * (pos - lo)


class SimMetrics:
    """MetricsProvider over the simulation's per-pool buckets (see autoscale_loop.py for the
    Prometheus metrics each field stands for)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def windows(self, pools, now: float) -> dict[str, PoolMetrics]:
        out = {}
        for name in pools:
            p = self.sim.pools[name]
            hist = list(p.history)
            arrivals = sum(b.arrivals for b in hist)
            lat = hist[-self.sim.latency_buckets:]
            ttft = [x for b in lat for x in b.ttft]
            tpot = [x for b in lat for x in b.tpot]
            samples = len(tpot) if p.spec.role == "decode" else len(ttft)
            out[name] = PoolMetrics(
                bucket_s=self.sim.tick_s, arrivals_rps=[b.arrivals / self.sim.tick_s for b in hist],
                mean_prompt_tokens=sum(b.prompt for b in hist) / arrivals if arrivals else 0.0,
                mean_output_tokens=sum(b.output for b in hist) / arrivals if arrivals else 0.0,
                ttft_p90_s=_p90(ttft) if ttft else None, tpot_p90_s=_p90(tpot) if tpot else None,
                latency_samples=samples, queue_depth=sum(b.queued for b in lat) / len(lat) if lat else 0.0,
                in_flight=sum(b.running for b in lat) / len(lat) if lat else 0.0)
        return out


class SimActuator:
    """PoolActuator over the simulated pools. Scale-up re-admits draining replicas first, then
    starts new ones (ready after ``startup_s``; beyond ``max_total_replicas`` they are pending until
    a replica leaves). Scale-down cancels pending, then starting (newest first), then drains the
    ready replicas with the fewest requests in flight."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def status(self, pool: str) -> PoolStatus:
        p = self.sim.pools[pool]
        states = [r.state for r in p.replicas.values()]
        return PoolStatus(pool, p.desired, states.count("ready"), states.count("starting"), p.pending,
                          states.count("draining"))

    def scale_to(self, pool: str, replicas: int) -> None:
        p, now = self.sim.pools[pool], self.sim.now
        p.desired = replicas
        live = [r for r in p.replicas.values() if r.state in ("starting", "ready")]
        have = len(live) + p.pending
        if replicas > have:
            for r in [r for r in p.replicas.values() if r.state == "draining"][:replicas - have]:
                r.state = "ready"
                p.routable.append(r)
                have += 1
            for _ in range(replicas - have):
                if self._room():
                    self.sim._push(now + p.spec.startup_s, READY, self.add_replica(p, now))
                else:
                    p.pending += 1
            return
        drop = have - replicas
        cancel = min(drop, p.pending)
        p.pending -= cancel
        drop -= cancel
        starting = sorted((r for r in live if r.state == "starting"), key=lambda r: -r.created_at)
        for r in starting[:drop]:
            self.remove(p, r)
        drop -= min(drop, len(starting))
        for r in sorted((r for r in live if r.state == "ready"), key=lambda r: r.in_flight)[:drop]:
            r.state = "draining"
            p.routable.remove(r)
            self.sim._maybe_leave(r)

    def _room(self) -> bool:
        total = sum(p.alive for p in self.sim.pools.values())
        return self.sim.max_total is None or total < self.sim.max_total

    def add_replica(self, p: _Pool, now: float) -> SimReplica:
        r = SimReplica(f"{p.name}-{p.next_index}", p.name, p.spec.service, p.colocated, now)
        p.next_index += 1
        p.replicas[r.worker_id] = r
        p.count_alive(now, +1)
        return r

    def remove(self, p: _Pool, r: SimReplica) -> None:
        assert r.idle(), f"{r.worker_id} removed with {r.in_flight} requests"
        r.state, r.left_at = "gone", self.sim.now
        del p.replicas[r.worker_id]
        p.count_alive(self.sim.now, -1)
        for q in self.sim.pools.values():  # a freed slot places a pending replica
            if q.pending and self._room():
                q.pending -= 1
                self.sim._push(self.sim.now + q.spec.startup_s, READY, self.add_replica(q, self.sim.now))
                break
