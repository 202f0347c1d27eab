"""PoolActuator: the one interface through which the SLO autoscaler changes a pool's size.

The autoscaler decides (a pure function of metrics, SLOs and capacity profiles) and an actuator
applies: the Ray actuator creates and drains worker actors in this process's Ray cluster; the
Kubernetes actuator patches a KubeRay ``RayCluster`` worker group's ``replicas`` where KubeRay's
in-tree autoscaler is off. Both report what they see with the same ``PoolStatus``, so the
decision logic never knows which one it drives.

Terms (per pool):
    desired   replicas asked for by the last ``scale_to`` (or the configured size)
    ready     replicas serving requests
    starting  replicas created but still loading: coming capacity, counted by the autoscaler so it
              does not ask twice for the same load
    pending   replicas that cannot be placed (no room in the cluster: a Ray placement group or a
              Kubernetes pod stuck Pending): reported, never counted as capacity
    draining  replicas told to stop taking new requests; they leave once idle (no request dropped)
    standby   replicas started and loaded but unrouted (no KV cache): a scale-up promotes them
              first, and they serve in about a second; not capacity until promoted

Invariant: ready + starting + pending + draining + standby covers every replica the actuator knows of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PoolStatus:
    pool: str
    desired: int
    ready: int
    starting: int
    pending: int
    draining: int = 0
    standby: int = 0
    standby_target: int = 0  # what the last set_standby asked for

    @property
    def capacity_replicas(self) -> int:
        """Replicas that serve now or soon: ready + starting (pending and draining excluded)."""
        return self.ready + self.starting


class PoolActuator(Protocol):
    """Applies replica counts to pools. Implementations: cluster.deploy.ray_actuator (Ray actors),
    cluster.deploy.k8s_actuator (KubeRay RayCluster worker groups)."""

    def status(self, pool: str) -> PoolStatus:
        """What the pool looks like now. Raises KeyError for an unknown pool."""
        ...

    def scale_to(self, pool: str, replicas: int) -> None:
        """Ask for ``replicas`` replicas. Scaling down drains (no request is dropped); the call
        returns once the request is recorded, not when the pool has reached the size. Scaling up
        promotes standby replicas first."""
        ...

    def set_standby(self, pool: str, replicas: int) -> None:
        """Keep ``replicas`` standby replicas in the pool (created and released in the background)."""
        ...
