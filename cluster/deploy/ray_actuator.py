"""RayActuator: the PoolActuator (cluster/autoscale/actuator.py) over this process's Ray pools.

``scale_to(pool, n)`` makes a pool's *live* replicas (every replica not draining) number ``n``:

    up      ``WorkerPool.add_replica`` creates a worker actor (or gang) where the pool's config
            places it -- a slot a removal freed in the pool's placement group, else a placement
            group of its own -- and ``Controller.add`` starts it. It is *pending* while its
            placement group waits for room in the cluster (not capacity: the autoscaler must not
            count it), *starting* while it loads, and joins the routers' member list once it serves.
    down    victims in this order: pending or failed, starting/restarting (nothing to drain: released
            at once), then serving replicas, newest first, which *drain* (``Controller.retire``):
            listed as draining so routers stop sending them work, ``stop(grace)`` lets their
            in-flight requests finish, then the actors are killed and the placement freed. No
            request is dropped: one routed during the hand-over is refused before its first token
            and retried elsewhere by the router; one that outlives ``drain_grace_s`` is resumed
            on another worker by the router.

Standby replicas (cluster/deploy/controller.py): ``scale_to`` promotes the pool's standby replicas
before it creates new ones (a promotion serves in about a second, a new replica after a full
start), and ``set_standby(pool, n)`` sets how many the controller keeps; they are no live replica
(``scale_to`` never removes one) and ``status`` reports them as ``standby``.

``status(pool)`` reads the controller's replica states: up -> ready; starting or down (Ray is
restarting it) -> starting, unless its bundles are not placed (not yet, or no longer: its node died
and Ray is re-placing them where there is room, ``WorkerPool.is_placed``) -> pending; failed (its
start raised; the controller does not retry) -> pending too, since it is asked for and not capacity;
draining -> draining. ``desired`` is the last ``scale_to`` (initially the configured size).

Example (what ``duet serve`` does with autoscaling on)::

    actuator = RayActuator(deployment.pools, deployment.controller, drain_grace_s=300)
    actuator.scale_to("decode", 3)
    actuator.status("decode")       # PoolStatus(pool='decode', desired=3, ready=2, starting=1, pending=0, draining=0)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from cluster.autoscale.actuator import PoolStatus
from cluster.deploy.controller import Controller
from cluster.deploy.pools import WorkerPool

logger = logging.getLogger(__name__)

_VICTIM_ORDER = {"pending": 0, "starting": 1, "up": 2}  # removed first -> last (then newest first)


class RayActuator:
    """Resizes ``pools`` (created by cluster.deploy.pools.create_pool and tracked by ``controller``)."""

    def __init__(self, pools: Sequence[WorkerPool], controller: Controller, *, drain_grace_s: float = 300.0,
                 drain_settle_s: float = 1.0) -> None:
        self._pools = {p.name: p for p in pools}
        self._controller = controller
        self.drain_grace_s = drain_grace_s
        self.drain_settle_s = drain_settle_s
        # standby and draining replicas (adopted so too, after a controller restart) are no live replica
        self._desired = {p.name: sum(not p.is_standby(r.worker_id) and p.drain_until(r.worker_id) is None
                                     for r in list(p.replicas)) for p in pools}
        self._lock = threading.Lock()  # one scale_to at a time

    def status(self, pool: str) -> PoolStatus:
        states = self._states(pool)
        count = {s: sum(1 for _, st in states if st == s) for s in ("up", "starting", "pending", "draining",
                                                                     "standby")}
        return PoolStatus(pool, self._desired[pool], count["up"], count["starting"], count["pending"],
                          count["draining"], standby=count["standby"],
                          standby_target=self._controller.standby_target(pool))

    def set_standby(self, pool: str, replicas: int) -> None:
        self._controller.set_standby(pool, replicas)

    def scale_to(self, pool: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"scale_to({pool!r}, {replicas}): replicas must be >= 0")
        p = self._pools[pool]
        with self._lock:
            live = [(row, st) for row, st in self._states(pool) if st not in ("draining", "standby")]
            if replicas > len(live):
                for _ in range(replicas - len(live)):
                    if (wid := self._controller.promote(pool)) is not None:
                        logger.info("ray actuator: pool %s: promoted standby %s", pool, wid)
                    else:
                        self._controller.add(p.add_replica())
            elif replicas < len(live):
                ranked = sorted(live, key=lambda x: (_VICTIM_ORDER[x[1]], -int(x[0]["index"])))
                for row, _state in ranked[: len(live) - replicas]:
                    logger.info("ray actuator: pool %s: removing %s (%s)", pool, row["worker_id"], row["state"])
                    self._controller.retire(row["worker_id"], drain_grace_s=self.drain_grace_s,
                                            drain_settle_s=self.drain_settle_s)
            self._desired[pool] = replicas

    def _states(self, pool: str) -> list[tuple[dict[str, Any], str]]:
        """(controller row, actuator state) of each replica of ``pool``; KeyError for an unknown pool."""
        p = self._pools[pool]
        replicas = {r.worker_id: r for r in list(p.replicas)}
        out = []
        for row in self._controller.describe():
            if row["pool"] != pool:
                continue
            state = str(row["state"])
            replica = replicas.get(str(row["worker_id"]))
            if row.get("standby"):  # preparing, standby or failed: a spare, never a live replica
                out.append((row, "standby"))
            elif state == "failed" or (state in ("starting", "down") and replica is not None
                                     and not p.is_placed(replica)):
                out.append((row, "pending"))
            elif state == "down":
                out.append((row, "starting"))
            else:
                out.append((row, state))
        return out
