"""The queue-length autoscaler: the baseline the SLO autoscaler is measured against.

It follows Ray Serve's default policy (``target_ongoing_requests``): keep the average number of
ongoing requests (running + queued) per replica at a target, knowing nothing of latency SLOs,
arrival trends or capacity profiles.

Algorithm, per pool, each decision round:
    ongoing   = window mean of requests running + queued on the pool (PoolMetrics.in_flight +
                queue_depth; Ray Serve averages over ``look_back_period_s``, default 30 s)
    proposal  = ceil(ongoing / target_ongoing_requests), clamped to [min, max]
    A proposal above the current size is applied once proposals have stayed above it for
    ``upscale_delay_s`` (Ray Serve default 30 s); below, after ``downscale_delay_s`` (default
    600 s) -- then to the latest proposal, as Ray Serve does. Replicas still starting are part of
    the current size (Ray Serve counts target replicas, not running ones).

Example: 8 replicas, 40 ongoing requests, target 2 -> proposal 20; if every round for the next
30 s proposes more than 8, the pool goes to the proposal of the round that completes the 30 s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.slo import Decision, PoolMetrics


@dataclass(frozen=True)
class QueueScaling:
    pool: str
    target_ongoing_requests: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 16
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"{self.pool}.target_ongoing_requests={self.target_ongoing_requests!r}: must be > 0")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"{self.pool}.min_replicas={self.min_replicas!r}: must be in 0..max_replicas "
                             f"({self.max_replicas})")


class QueueLengthAutoscaler:
    """ScalingPolicy (cluster/autoscale/loop.py) implementing the module docstring."""

    def __init__(self, pools: tuple[QueueScaling, ...]) -> None:
        self.scaling = {p.pool: p for p in pools}
        self.pools = tuple(self.scaling)
        self._since: dict[str, tuple[str, float]] = {}  # pool -> (direction, since when)

    def decide(self, now: float, metrics: Mapping[str, PoolMetrics],
               status: Mapping[str, PoolStatus]) -> dict[str, Decision]:
        out = {}
        for name, p in self.scaling.items():
            m, current = metrics[name], status[name].desired
            ongoing = m.in_flight + m.queue_depth
            proposal = max(p.min_replicas, min(p.max_replicas, math.ceil(ongoing / p.target_ongoing_requests - 1e-9)))
            direction = "up" if proposal > current else "down" if proposal < current else "hold"
            prev = self._since.get(name)
            if prev is None or prev[0] != direction:
                prev = self._since[name] = (direction, now)
            desired, delay = current, p.upscale_delay_s if direction == "up" else p.downscale_delay_s
            if direction != "hold" and now - prev[1] >= delay:
                desired = proposal
                self._since.pop(name)
            out[name] = Decision(name, current, desired, f"ongoing {ongoing:.1f} / target {p.target_ongoing_requests:g}"
                                 f" -> {proposal} ({direction} for {now - prev[1]:.0f} s)",
                                 capacity_replicas=status[name].capacity_replicas, pending=status[name].pending)
        return out
