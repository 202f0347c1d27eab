"""Waking pools scaled to zero: what the controller does when a router holds a request no member
can take (duet.control.v1.Membership/Wake, cluster/deploy/membership_service.py).

``PoolWaker.wake(roles)`` looks at every pool whose role is in ``roles`` (all pools when empty):

    desired 0                  it was scaled to zero: ``scale_to(pool, 1)`` through the deployment's
                               actuator, which promotes a standby replica when the pool keeps one
                               (serving in about a second) and otherwise starts a new one -> woken
                               (and from_standby when a standby was there to promote)
    desired >= 1, none ready   a wake (or a scale-up) is already on its way -> waking
    ready >= 1                 nothing to do (the router will see the member shortly)

The autoscaler (cluster/autoscale/slo.py step 7) sees the activity on its next round and holds the
pool at one or more replicas; it scales it back to zero only after ``scale_to_zero_after_s`` idle.

Example::

    waker = PoolWaker(actuator, {"default": "colocated"})
    waker.wake(["colocated", "decode"])     # WakeOutcome(woken=('default',), waking=(), from_standby=('default',))
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.autoscale.actuator import PoolActuator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WakeOutcome:
    woken: tuple[str, ...] = ()
    waking: tuple[str, ...] = ()
    from_standby: tuple[str, ...] = ()


class PoolWaker:
    """Wakes ``roles``' pools (``pool -> role``) through ``actuator`` (module docstring)."""

    def __init__(self, actuator: PoolActuator, roles: Mapping[str, str]) -> None:
        self._actuator, self._roles = actuator, dict(roles)
        self._lock = threading.Lock()
        self.num_wakes = 0  # pools woken
        self.woken_at: dict[str, float] = {}  # pool -> time.monotonic() of its latest wake

    def wake(self, roles: Sequence[str], requester: str = "") -> WakeOutcome:
        woken, waking, from_standby = [], [], []
        with self._lock:
            for pool, role in self._roles.items():
                if roles and role not in roles:
                    continue
                st = self._actuator.status(pool)
                if st.desired == 0:
                    if st.standby:
                        from_standby.append(pool)
                    self._actuator.scale_to(pool, 1)
                    woken.append(pool)
                    self.num_wakes += 1
                    self.woken_at[pool] = time.monotonic()
                    logger.info("wake: pool %s scaled up from zero for %s (%s)", pool, requester or "a router",
                                "promoting a standby replica" if st.standby else "starting a replica")
                elif st.ready == 0:
                    waking.append(pool)
        return WakeOutcome(tuple(woken), tuple(waking), tuple(from_standby))
