"""The simulator's migration cost model: scale-down moves running requests instead of waiting.

Without it (``SimPool.migration = None``) a replica being removed drains: it takes no new request
and leaves once the requests on it have finished -- for a decode replica, after the longest
remaining generation (minutes, with long outputs). With a ``MigrationModel`` it empties itself:

    queued prompts   not started yet: sent to another replica at once (nothing computed is lost)
    running prefill  finishes where it is (sub-second), then its decode migrates like the others
    decoding         one at a time over the replica's link, the sequence with the most tokens to go
                     first: it leaves the batch, its KV (prompt + tokens generated so far) travels,
                     and it resumes on the replica the pool's routing policy picks, with exactly the
                     tokens it still had to generate (nothing is recomputed). Cost of one request:

                         seconds = context_tokens x kv_bytes_per_token / bandwidth_bytes_per_s + pause_s

                     The stall counts in that request's TPOT. Once the sequence with the most tokens
                     to go would finish in place sooner than it would move (tokens left x the current
                     step time <= its migration time), migration stops: every sequence still here
                     has fewer tokens to go, and they finish in place.
    leaves           when nothing is left on it and its last transfer has arrived

The rebalancer (``SimPool.rebalance``, off by default like the router's): every tick, a replica
holding more than the pool's mean + max(2, mean / 2) decoding sequences sends its surplus over the
mean, longest first and at the same cost per request, to the replicas furthest below the mean (each
filled up to it, never past it, so a moved sequence is not moved back). It is what lets replicas
started for a burst take over the sequences the overloaded ones already hold, instead of serving
only new arrivals while the old ones stay overloaded until their sequences end.

A migration that finds no ready replica to go to leaves the request where it is (it drains), as the
real migration leaves a request running on its source when the target cannot take it. The
target's link and memory are not modelled as limits (each source sends over its own link; targets
take a migrated sequence like any other, waiting for a batch slot if they are full).

Where the defaults come from (a GPU-class replica of a mid-size model, as benchmarks/autoscale_sim.py
models): ``kv_bytes_per_token`` = 2 (K and V) x 32 layers x 8 KV heads x 128 head dims x 2 bytes
(bf16) = 131,072 -- a Llama-3-8B-shaped model; use ``kv_bytes_per_token_of`` for another. The
bandwidth is 1 GB/s: an order of magnitude under NCCL across nodes (10-50 GB/s on 100-400 Gb/s
links) and ten times what today's gloo TCP path reaches on the 2-core test machine (4.8% of a
memcpy that measures 1.2-2.3 GB/s there, issue 22); ``--bandwidth-gbs`` in the autoscaler
benchmarks changes it. ``pause_s`` = 0.2 s per request: the source stops the sequence at a step boundary and the
target admits it at its next one (two decode steps, up to 84 ms each at the benchmark's batch of
16) plus the reserve / send / resume / stream-switch round trips (a few ms each on one host).

Example::

    m = MigrationModel()
    m.seconds(3000)          # 3,000 context tokens: 3000 x 131072 / 1e9 + 0.2 = 0.59 s
    SimPool("decode", "decode", svc, replicas=8, migration=m)
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from cluster.sim.pool import PoolState
from cluster.sim.replica import SimReplica


class MigrationHost(Protocol):
    """What the migrator reads and calls on the running simulation (cluster/sim/simulator.py)."""

    pools: dict[str, PoolState]
    now: float

    def send_entry(self, pool: PoolState, i: int) -> None: ...
    def maybe_leave(self, r: SimReplica) -> None: ...
    def pick(self, pool: PoolState, cands: list[SimReplica], i: int) -> SimReplica: ...
    def resched(self, r: SimReplica) -> None: ...
    def push_migration(self, t: float, source: SimReplica, arrival: tuple[SimReplica, int, float, int]) -> None: ...


@dataclass
class MigrationStats:
    """What the run's migrations did: count, bytes moved, and per pool, for each removed replica,
    the seconds from the scale-down decision to the replica leaving (drained or migrated)."""

    migrations: int = 0  # all of them: drains and rebalancing
    rebalanced: int = 0  # of which the rebalancer's
    bytes: float = 0.0
    stall_s: float = 0.0  # sum over migrated requests of the time they made no progress
    drain_s: dict[str, list[float]] = field(default_factory=dict)


class Migrator:
    """Runs the migrations of the simulation's draining replicas, and the rebalancer's. The
    simulation calls ``start`` when a replica of a pool with a MigrationModel starts draining (or
    gets new work while draining), ``rebalance`` every tick for a pool with ``rebalance`` on,
    ``step`` on a MIGRATE_NEXT event and ``arrive`` on a MIGRATE_DONE event."""

    def __init__(self, sim: MigrationHost) -> None:
        self.sim = sim
        self.sending: set[str] = set()  # sources with a transfer in flight
        self.planned: dict[str, deque[SimReplica]] = {}  # rebalancing: source -> a target per sequence
        self.stats = MigrationStats()

    def busy(self, r: SimReplica) -> bool:
        return r.worker_id in self.sending

    def start(self, r: SimReplica) -> None:
        """``r`` drains by migration: re-send its queued prompts, then move its sequences."""
        pool = self.sim.pools[r.pool]
        self.planned.pop(r.worker_id, None)
        if pool.spec.role != "decode":
            for i in r.take_queued_prefills():
                self.sim.send_entry(pool, i)
        if not self.busy(r):
            self.step(r)

    def rebalance(self, pool: PoolState) -> None:
        """The router's rebalancer (module docstring): replicas holding more than the pool's mean
        + max(2, mean / 2) sequences send their surplus over the mean to the replicas furthest
        below it, each sent sequence filling the coolest one by one (never above the mean)."""
        reps = pool.routable
        if len(reps) < 2:
            return
        load = {r.worker_id: len(r.batch) + len(r.waiting) for r in reps}
        mean = sum(load.values()) / len(reps)
        hot = sorted((r for r in reps if load[r.worker_id] > mean + max(2.0, mean / 2) and not self.busy(r)
                      and r.worker_id not in self.planned), key=lambda r: -load[r.worker_id])
        if not hot:
            return
        cool = [(load[r.worker_id], i, r) for i, r in enumerate(reps) if load[r.worker_id] < math.floor(mean)]
        heapq.heapify(cool)
        for h in hot:
            targets: deque[SimReplica] = deque()
            for _ in range(load[h.worker_id] - math.ceil(mean)):
                if not cool or cool[0][0] >= math.floor(mean):
                    break
                n, i, c = heapq.heappop(cool)
                targets.append(c)
                heapq.heappush(cool, (n + 1, i, c))
            if targets:
                self.planned[h.worker_id] = targets
                self.step(h)

    def step(self, r: SimReplica) -> None:
        """The source's link is free: move the next sequence, or stop (module docstring)."""
        sim, now = self.sim, self.sim.now
        self.sending.discard(r.worker_id)
        pool = sim.pools[r.pool]
        model = pool.spec.migration
        assert model is not None
        if r.state == "draining":
            targets = [t for t in pool.routable if t is not r]
        else:  # rebalancing: the planned target, while it still serves
            plan = self.planned.get(r.worker_id)
            while plan and plan[0].state != "ready":
                plan.popleft()
            if not plan:
                self.planned.pop(r.worker_id, None)
                return
            targets = [plan.popleft()]
        pick = r.longest_decode(now) if r.state in ("draining", "ready") else None
        if pick is None or not targets:
            self.planned.pop(r.worker_id, None)
            sim.maybe_leave(r)
            return
        req, left, context = pick
        cost = model.seconds(context)
        if left * r.svc.decode_step_s(max(1, len(r.batch))) <= cost:
            self.planned.pop(r.worker_id, None)
            sim.maybe_leave(r)  # finishing in place is sooner, for this one and all the rest
            return
        target = sim.pick(pool, targets, req) if len(targets) > 1 else targets[0]
        left, context = r.remove_decode(req, now)
        pool.policy.on_request_complete(r.worker_id, str(req))  # the source holds nothing of it any more
        sim.resched(r)
        target.in_flight += 1  # reserved on the target while the KV travels
        self.sending.add(r.worker_id)
        self.stats.migrations += 1
        self.stats.bytes += model.nbytes(context)
        self.stats.stall_s += cost
        if r.state != "draining":
            self.stats.rebalanced += 1
        sim.push_migration(now + cost, r, (target, req, left, context))

    def arrive(self, target: SimReplica, req: int, left: float, context: int) -> None:
        """The KV is on the target: the sequence resumes there with the tokens it had to go."""
        target.join_decode(req, left, context, self.sim.now, counted=False)
        self.sim.resched(target)
        if target.state == "draining":
            self.start(target)
