"""How many standby replicas a pool keeps, and when an idle pool goes to zero (steps 6 and 7 of
cluster/autoscale/slo.py's algorithm). Pure functions of a round's estimate and the pool's memory.

Terms (per pool):
    standby      replicas started and loaded but unrouted (no KV cache; cluster/deploy/controller.py):
                 a scale-up promotes them first and they serve in about a second (``standby_s``),
                 where a new replica serves only after a start-up (``horizon_s``, ~ the start-up)
    burst risk   the replicas a burst would need on top of what the pool had: each round, the work of
                 the forecast over the work of the window's mean rate before the last ``horizon_s``
                 (load that arrived faster than a new replica starts), in replicas at the pool's
                 capacity with headroom, remembered as a decaying maximum with time constant
                 ``standby_memory_s``: risk_t = max(rise_t, risk_{t-1} x exp(-dt / standby_memory_s)).
                 Bursts are rare, so the pool prepares for the largest one it saw lately, forgetting
                 it over an hour by default
    standby      the risk rounded to whole replicas, at most ``max_standby``: that many spares absorb the burst's first
                 start-up time while the new replicas start behind them. A pool that scales to zero
                 keeps at least one (it wakes in seconds instead of a start-up) when max_standby >= 1
    cost         a standby replica holds its process and reserved CPUs or GPU but no KV cache, and,
                 with weights shared per node, no copy of the weights: ``standby_cost`` is its cost in
                 serving replicas (the decision's reason reports N x standby_cost; the simulator
                 counts it in replica-hours)

Scale to zero (``min_replicas`` 0): the pool goes to zero replicas once it has been idle -- no
arrival in a bucket, nothing running or queued, no replica starting -- for ``scale_to_zero_after_s``; any
activity, or a replica waking (the router asks the controller to wake the pool when a request
arrives for it, cluster/deploy/membership_service.py), keeps it at one or more.

Worked example (decode pool, capacity 102.4 output tok/s per replica, 64 output tokens per
request, headroom 0.1, max_standby 4): a round whose forecast is 3 req/s above the window's mean
before the last horizon rises 3 x 64 / 102.4 x 1.1 = 2.06 replicas -> risk 2.06 -> 2 standby.
Thirty minutes later with no new burst (standby_memory_s 3600) the risk is 2.06 x e^-0.5 = 1.25
-> 1 standby; after two hours 0.28 -> none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StandbyMemory:
    """What a pool remembers between rounds for steps 6 and 7."""

    risk: float = 0.0  # burst risk, replicas (module docstring)
    risk_at: float = -math.inf  # when ``risk`` was last updated
    last_active: float = -math.inf  # the last round that saw activity or a replica starting


def burst_risk(mem: StandbyMemory, now: float, rise_replicas: float, memory_s: float) -> float:
    """The decayed maximum of the rises seen (module docstring)."""
    decayed = mem.risk * math.exp(-(now - mem.risk_at) / memory_s) if memory_s > 0 and mem.risk > 0 else 0.0
    return max(max(0.0, rise_replicas), decayed)


def standby_count(risk: float, max_standby: int, *, to_zero: bool) -> int:
    """Standby replicas for a burst risk of ``risk`` replicas, within [0, max_standby]; a pool that
    scales to zero keeps at least one spare to wake from (when any are allowed)."""
    want = math.floor(risk + 0.5)  # the nearest whole replica: a faded risk of 0.1 replica keeps none
    if to_zero:
        want = max(want, 1)
    return max(0, min(max_standby, want))


def idle(arrivals_rps: Sequence[float], in_flight: float, queue_depth: float, starting: int) -> bool:
    """No arrival in the latest bucket, nothing running or queued, and no replica starting."""
    return not (arrivals_rps and arrivals_rps[-1]) and in_flight == 0 and queue_depth == 0 and starting == 0
