"""A simulated pool: its settings (``SimPool``, with the cost of moving a running request,
``MigrationModel``) and its state while the simulation runs (``PoolState``: replicas, the router's
queue, per-tick metric buckets, replica-seconds). cluster/sim/simulator.py runs the events;
cluster/sim/control.py and cluster/sim/migration.py act on pools through these types.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cluster.autoscale.profile import ServiceModel
from cluster.sim.replica import SimReplica
from cluster.sim.spec import DraftCost, SpecCounters, SpecModel
from router.policies import RoutingPolicy


def kv_bytes_per_token_of(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token holds: K and V for every layer and KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class MigrationModel:
    """What moving one running request costs (module docstring). Raises ValueError naming a bad field."""

    kv_bytes_per_token: float = float(kv_bytes_per_token_of(32, 8, 128))
    bandwidth_bytes_per_s: float = 1e9
    pause_s: float = 0.2

    def __post_init__(self) -> None:
        for key in ("kv_bytes_per_token", "bandwidth_bytes_per_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"migration.{key}={v!r}: must be a number > 0")
        if not (math.isfinite(self.pause_s) and self.pause_s >= 0):
            raise ValueError(f"migration.pause_s={self.pause_s!r}: must be a number of seconds >= 0")

    def seconds(self, context_tokens: float) -> float:
        """Time to move one request whose KV holds ``context_tokens`` tokens."""
        return context_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s + self.pause_s

    def nbytes(self, context_tokens: float) -> float:
        return context_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class SimPool:
    """One simulated pool. role: colocated | prefill | decode | drafter. migration: how a removed
    replica's running requests move (None: it drains, waiting for them to finish). rebalance: every
    tick, replicas far above the pool's mean load move sequences to the ones below it (the router's
    rebalancer; cluster/sim/migration.py). spec: a decoding pool's speculation (cluster/sim/spec.py);
    draft: a drafter pool's round cost (its ``service`` is unused).

    startup_s: a new replica's time from the scale-up decision to serving; standby_s: a standby
    replica's (promoted); both measured per model and device (cluster/sim/startup.py,
    benchmarks/startup_bench.py). standby: standby replicas kept from the start (the autoscaler
    may change the count); a standby takes startup_s to become one, costs ``standby_cost``
    serving replicas while it waits, and a scale-up promotes it before starting new replicas."""

    name: str
    role: str
    service: ServiceModel
    replicas: int = 1
    startup_s: float = 60.0
    policy: str = "least_loaded"
    policy_options: dict[str, Any] = field(default_factory=dict, hash=False)
    migration: MigrationModel | None = None
    rebalance: bool = False
    standby_s: float = 1.0
    standby: int = 0
    standby_cost: float = 0.1
    spec: SpecModel | None = None
    draft: DraftCost | None = None

    def __post_init__(self) -> None:
        if self.rebalance and self.migration is None:
            raise ValueError(f"pool {self.name!r}: rebalance moves running requests, so it needs a migration model")
        for key in ("startup_s", "standby_s", "standby_cost"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"pool {self.name!r}: {key}={v!r}: must be a number >= 0")
        if (self.role == "drafter") != (self.draft is not None):
            raise ValueError(f"pool {self.name!r}: a drafter pool needs a draft cost, and only a drafter pool has one")
        if self.spec is not None and (self.role not in ("colocated", "decode") or self.migration is not None):
            raise ValueError(f"pool {self.name!r}: speculation is simulated on colocated and decode pools without "
                             "migration (a migrating speculative request is not modelled)")


@dataclass
class Bucket:
    """What one pool saw in one tick (the autoscaler's metrics bucket)."""

    arrivals: int = 0
    prompt: int = 0
    output: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    queued: float = 0.0
    running: float = 0.0
    rows: float = 0.0  # drafter pools: requests drafting on its replicas at the tick
    unserved: float = 0.0  # drafter pools: requests decoding without drafts, no replica had room
    spec: SpecCounters | None = None  # speculating pools: the counters over the tick


class PoolState:
    """A simulated pool while the simulation runs: its replicas, router queue and accounting."""

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
        self.standby_target = spec.standby
        self.spares: list[SimReplica] = []  # standby replicas: preparing (loading) or standby (loaded)
        self.spares_since = 0.0
        self.standby_seconds = 0.0  # replica-seconds of standby replicas (costed at spec.standby_cost)
        self.promotions = 0
        self.wakes = 0  # scaled up from zero by an arriving request
        self.bucket = Bucket()
        self.history: deque[Bucket] = deque()
        self.spec_counters = SpecCounters()  # since the last tick (speculating pools)
        self.spec_total = SpecCounters()

    def count_alive(self, now: float, delta: int) -> None:
        self.replica_seconds += self.alive * (now - self.alive_since)
        self.alive, self.alive_since = self.alive + delta, now

    def count_spares(self, now: float) -> None:
        """Close the standby replica-seconds up to ``now`` (call before changing ``spares``)."""
        self.standby_seconds += len(self.spares) * (now - self.spares_since)
        self.spares_since = now
