"""What the autoscaler carries over a controller restart, as JSON, and how times survive the move.

A restarted controller (cluster/deploy/registry.py: it adopts the workers under the dead one's
lease) would otherwise start its autoscaler fresh: cooldowns forgotten (a pool scaled down a
minute ago could be scaled down again at once), the reactive offset and the standby burst risk
lost, and no metrics window for two rounds (every pool holds). The control loop
(cluster/autoscale/loop.py) saves a *snapshot* after each round into a ``StateStore`` (on an
existing Ray cluster: the registry's ``state_store("autoscaler")``, Ray's KV) and restores it once,
before its first round:

    policy      the SLO autoscaler's memory per pool (slo.py PoolMemory: last scale-up / down /
                reactive step / starting, offset, last p90 ratio, standby burst risk and activity)
    provider    the metrics window's readings (metrics.py PrometheusWindows: per router, the
                cumulative counters it exported at each round), so the first round after a
                restart differences against the last one before it: nothing counted twice or lost
    standby     each pool's standby target as the actuator had it (the autoscaler sets it; the
                configured ``standby_replicas`` would otherwise release spares it asked for)

Times: the loop's clock is ``time.monotonic`` (per process, per node), so a time is saved as its age
at the save (``now - t``; None for "never") with the save's wall-clock time, and restored as
``now' - elapsed - age``, where elapsed is the wall-clock time since the save (the restart's gap).

Example: a scale-up 40 s before the save, and a restart 15 s after it: restored last_up is
``now' - 55``, so an ``up_cooldown_s`` of 30 s has passed, a ``down_cooldown_s`` of 300 s has 245 s left.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from cluster.autoscale.slo import AutoscalerConfig, AutoscalerState, PoolMemory
from cluster.autoscale.standby import StandbyMemory

VERSION = 1  # of the snapshot's layout; another version is not restored (logged)
_MEMORY_TIMES = ("last_up", "last_down", "last_reactive", "last_starting")
_STANDBY_TIMES = ("risk_at", "last_active")


class StateStore(Protocol):
    """Where snapshots go: ``save`` returns False when it did not write (e.g. the lease is not held)."""

    def save(self, payload: dict) -> bool: ...

    def load(self) -> dict | None: ...


@runtime_checkable
class Persistent(Protocol):
    """A loop component (policy or metrics provider) that carries state over a restart."""

    def snapshot(self, now: float) -> dict: ...

    def restore(self, data: Mapping[str, Any], saved_at: float, now: float) -> None:
        """``saved_at``: the save's moment on this process' clock (now - the wall-clock time since)."""
        ...


def age(t: float, now: float) -> float | None:
    """A time as its age at ``now`` (None: never, -inf)."""
    return None if math.isinf(t) else now - t


def at(age_s: float | None, now: float) -> float:
    """The inverse of ``age`` on another clock whose ``now`` is the same moment."""
    return -math.inf if age_s is None else now - age_s


def state_to_json(state: AutoscalerState, now: float) -> dict:
    """The SLO autoscaler's memory, times as ages at ``now`` (module docstring)."""
    out = {}
    for pool, m in state.pools.items():
        d: dict[str, Any] = {f.name: getattr(m, f.name) for f in fields(m) if f.name != "standby"}
        for k in _MEMORY_TIMES:
            d[k] = age(d[k], now)
        d["standby"] = {"risk": m.standby.risk, **{k: age(getattr(m.standby, k), now) for k in _STANDBY_TIMES}}
        out[pool] = d
    return out


def state_from_json(data: Mapping[str, Any], now: float) -> AutoscalerState:
    """``state_to_json``'s inverse; ``now`` is the save's moment on this clock."""
    pools = {}
    for pool, d in data.items():
        sb = d.get("standby", {})
        standby = StandbyMemory(risk=float(sb.get("risk", 0.0)), **{k: at(sb.get(k), now) for k in _STANDBY_TIMES})
        pools[pool] = PoolMemory(last_up=at(d.get("last_up"), now), last_down=at(d.get("last_down"), now),
                                 last_reactive=at(d.get("last_reactive"), now),
                                 last_starting=at(d.get("last_starting"), now), offset=int(d.get("offset", 0)),
                                 last_ratio=d.get("last_ratio"), standby=standby)
    return AutoscalerState(MappingProxyType(pools))


def standby_targets(payload: Mapping[str, Any] | None, config: AutoscalerConfig) -> dict[str, int]:
    """The saved standby target of each pool whose standby count the autoscaler sets (max_standby > 0)."""
    if not payload or payload.get("version") != VERSION:
        return {}
    saved = payload.get("standby", {})
    return {p.pool: min(int(saved[p.pool]), p.max_standby) for p in config.pools
            if p.max_standby > 0 and p.pool in saved}
