"""The simulator's control-plane adapters: what the real control loop (cluster/autoscale/loop.py)
reads and drives, over the simulated pools of cluster/sim/simulator.py.

    SimMetrics    the MetricsProvider: each pool's window of per-tick buckets, the same fields a
                  Prometheus-backed provider reads (see autoscale_loop.py for the metric names)
    SimActuator   the PoolActuator: a scale-up promotes the pool's loaded standby replicas first
                  (each serves after ``standby_s``), then starts new replicas (after ``startup_s``;
                  beyond ``max_total_replicas`` they are pending until a replica leaves). The
                  standby count is kept at its target (``set_standby``): a promoted spare is
                  replaced by a new one that loads for ``startup_s``. Scale-down cancels pending,
                  then starting (newest first), then removes the ready replicas with the fewest
                  requests in flight: they drain, or migrate their requests away when the pool has
                  a MigrationModel (cluster/sim/migration.py)
"""

from __future__ import annotations

import math
from typing import Protocol

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.drafter import DraftWindow
from cluster.autoscale.slo import PoolMetrics
from cluster.sim.migration import Migrator
from cluster.sim.pool import PoolState
from cluster.sim.replica import SimReplica


class ControlHost(Protocol):
    """What the simulated metrics and actuator read and call on the running simulation
    (cluster/sim/simulator.py)."""

    pools: dict[str, PoolState]
    now: float
    tick_s: float
    latency_buckets: int
    max_total: int | None
    migrator: Migrator

    def schedule_ready(self, r: SimReplica, after_s: float | None = None) -> None: ...
    def drain(self, r: SimReplica) -> None: ...


def p90(xs: list[float]) -> float:
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

    def __init__(self, sim: ControlHost) -> None:
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
                ttft_p90_s=p90(ttft) if ttft else None, tpot_p90_s=p90(tpot) if tpot else None,
                latency_samples=samples, queue_depth=sum(b.queued for b in lat) / len(lat) if lat else 0.0,
                in_flight=sum(b.running for b in lat) / len(lat) if lat else 0.0, draft=_draft(p, lat))
        return out


def _draft(p: PoolState, lat: list) -> DraftWindow | None:
    """A drafter pool's rows, or a speculating pool's counters, over the latency buckets (as
    cluster/autoscale/metrics.py reads them live)."""
    if p.spec.role == "drafter":
        n = max(len(lat), 1)
        return DraftWindow(rows=sum(b.rows for b in lat) / n, unserved=sum(b.unserved for b in lat) / n)
    if p.spec.spec is None:
        return None
    got = [b.spec for b in lat if b.spec is not None]
    return DraftWindow(**{k: sum(getattr(c, k) for c in got) for k in ("verifies", "draft_tokens", "accepted_tokens",
                                                                         "emitted_tokens", "draft_wait_s", "verify_s")})


class SimActuator:
    """PoolActuator over the simulated pools (module docstring). Scale-up re-admits draining
    replicas first (a migration in progress stops), then starts new ones."""

    def __init__(self, sim: ControlHost) -> None:
        self.sim = sim

    def status(self, pool: str) -> PoolStatus:
        p = self.sim.pools[pool]
        states = [r.state for r in p.replicas.values()]
        return PoolStatus(pool, p.desired, states.count("ready"), states.count("starting"), p.pending,
                          states.count("draining"), standby=len(p.spares), standby_target=p.standby_target)

    def set_standby(self, pool: str, replicas: int) -> None:
        p = self.sim.pools[pool]
        p.standby_target = replicas
        self.keep_standby(p)

    def keep_standby(self, p: PoolState) -> None:
        """The pool's standby count to its target: new spares load for startup_s, extra ones go
        (the ones still loading first)."""
        now = self.sim.now
        p.count_spares(now)
        while len(p.spares) < p.standby_target:
            r = SimReplica(f"{p.name}-{p.next_index}", p.name, p.spec.service, p.colocated, now)
            p.next_index += 1
            r.state = "preparing"
            p.spares.append(r)
            self.sim.schedule_ready(r, p.spec.startup_s)
        if len(p.spares) > p.standby_target:
            p.spares.sort(key=lambda r: r.state == "standby")  # preparing ones go first
            for r in p.spares[: len(p.spares) - p.standby_target]:
                r.state = "gone"
            p.spares = p.spares[len(p.spares) - p.standby_target:]

    def _promote(self, p: PoolState, now: float) -> bool:
        spare = next((r for r in p.spares if r.state == "standby"), None)
        if spare is None:
            return False
        p.count_spares(now)
        p.spares.remove(spare)
        spare.state, spare.created_at = "starting", now
        p.replicas[spare.worker_id] = spare
        p.count_alive(now, +1)
        p.promotions += 1
        self.sim.schedule_ready(spare, p.spec.standby_s)
        return True

    def scale_to(self, pool: str, replicas: int) -> None:
        p, now = self.sim.pools[pool], self.sim.now
        p.desired = replicas
        live = [r for r in p.replicas.values() if r.state in ("starting", "ready")]
        have = len(live) + p.pending
        if replicas > have:
            for r in [r for r in p.replicas.values() if r.state == "draining"][:replicas - have]:
                r.state, r.drain_at = "ready", float("inf")
                p.routable.append(r)
                have += 1
            while have < replicas and self._promote(p, now):
                have += 1
            self.keep_standby(p)
            for _ in range(replicas - have):
                if self._room():
                    self.sim.schedule_ready(self.add_replica(p, now))
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
        going = sorted((r for r in live if r.state == "ready"), key=lambda r: r.in_flight)[:drop]
        for r in going:
            r.state, r.drain_at = "draining", now
            p.routable.remove(r)
        for r in going:  # once every removal is decided: a migration goes to a replica that stays
            self.sim.drain(r)

    def _room(self) -> bool:
        total = sum(p.alive for p in self.sim.pools.values())
        return self.sim.max_total is None or total < self.sim.max_total

    def add_replica(self, p: PoolState, now: float) -> SimReplica:
        r = SimReplica(f"{p.name}-{p.next_index}", p.name, p.spec.service, p.colocated, now)
        if p.spec.spec is not None:  # a speculating pool's replica integrates its counters (cluster/sim/spec.py)
            r.counters, r.verify_token_cost = p.spec_counters, p.spec.spec.verify_token_cost
        p.next_index += 1
        p.replicas[r.worker_id] = r
        p.count_alive(now, +1)
        return r

    def remove(self, p: PoolState, r: SimReplica) -> None:
        assert r.idle(), f"{r.worker_id} removed with {r.in_flight} requests"
        if r.state == "draining":
            self.sim.migrator.stats.drain_s.setdefault(p.name, []).append(self.sim.now - r.drain_at)
        r.state, r.left_at = "gone", self.sim.now
        del p.replicas[r.worker_id]
        p.count_alive(self.sim.now, -1)
        for q in self.sim.pools.values():  # a freed slot places a pending replica
            if q.pending and self._room():
                q.pending -= 1
                self.sim.schedule_ready(self.add_replica(q, self.sim.now))
                break
