"""The actuator ``duet serve`` uses, chosen by ``autoscaling.actuator``; and KubeRayPoolActuator.

``make_actuator`` returns:

    ray         RayActuator (cluster/deploy/ray_actuator.py): worker actors added and drained in this
                process's Ray cluster. Where the capacity comes from is not its business: a fixed
                cluster, or KubeRay's in-tree autoscaler adding pods for pending placement groups.
    kubernetes  KubeRayPoolActuator (below): the RayActuator plus the pool's KubeRay worker group
                resized by KubeRayActuator (cluster/deploy/k8s_actuator.py) -- for a RayCluster whose
                in-tree autoscaler is off, where nobody else would add or remove pods.

On Kubernetes the pods are only room: the Duet workers are Ray actors this process creates
(cluster/deploy/pools.py). So patching a group's ``replicas`` alone would add idle pods, and the actors
alone would wait for room forever. KubeRayPoolActuator does both, in the order that never takes
capacity from a serving replica on purpose (the chart gives each replica one pod of its group):

    up      patch the group to ``n`` pods first, then ``RayActuator.scale_to(n)``: the new actors'
            placement groups are *pending* until the pods join Ray, then *starting* while they load.
    down    ``RayActuator.scale_to(n)`` first: the victims drain (routers stop sending them work,
            in-flight requests get ``drain_grace_s``, then the actors are killed and their bundles
            freed). The group is shrunk to ``n`` pods only once the pool has no draining replica
            left (checked on every ``status``/``scale_to`` call, i.e. every autoscaler round). A
            scale-up while a shrink waits cancels it; the group never has fewer pods than the
            pool has live plus draining replicas.

Which pods go: the shrink patch names, in the group's ``scaleStrategy.workersToDelete``, pods that
host no replica of the pool (a pod's IP is its Ray node's IP, the host of the endpoints of the
replicas on it; unschedulable pods first, then starting, then ready ones), and KubeRay deletes those
first. The shrink also waits while a replica of the pool is *starting* (its endpoint, so its pod,
is not known yet). What is still NOT guaranteed: only a replica's leader rank has an endpoint, so a
gang straddling two pods (possible without ``placementStrategy: PACK``, see the chart README) may
have a rank on a pod that looks idle; and if fewer pods look idle than must go, KubeRay picks the
rest (logged). A replica on a deleted pod ends like a failed worker: Ray re-places its bundle, the
controller restarts it, and the router resumes its interrupted streams on other workers.

Standby replicas (``set_standby``) are pods of the group as well: the group holds the pool's
serving replicas plus its standby ones. What is NOT guaranteed: a standby has no endpoint, so the
pod hosting one looks idle to a shrink (above) and may be picked; the replica then ends like a
failed worker and the controller replaces it.

``status(pool)`` is the RayActuator's (replica states as the controller sees them: a replica whose
pod is Pending/Unschedulable shows as *pending* because its placement group is not placed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cluster.autoscale.actuator import PoolActuator, PoolStatus
from cluster.config.autoscale import AutoscalingSection

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeRayPoolActuator:
    """Actors through ``ray`` (a RayActuator), pods through ``kube`` (a KubeRayActuator); see the
    module docstring for the order of the two on the way up and down."""

    def __init__(self, ray: PoolActuator, kube: Any, hosts: Callable[[str], set[str]] | None = None) -> None:
        """hosts(pool): the IPs of the pods hosting the pool's replicas (their endpoints' hosts);
        None = do not name pods to delete (KubeRay picks them all)."""
        self._ray, self._kube, self._hosts = ray, kube, hosts
        self._pods: dict[str, int] = {}  # pool -> group size last set (initially the configured size)
        self._shrink: dict[str, int] = {}  # pool -> group size to apply once its drains are done
        self._standby: dict[str, int] = {}  # pool -> standby replicas last set (pods beside the serving ones)
        self._lock = threading.Lock()

    def status(self, pool: str) -> PoolStatus:
        status = self._ray.status(pool)
        with self._lock:
            self._settle(pool, status)
        return status

    def scale_to(self, pool: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"scale_to({pool!r}, {replicas}): replicas must be >= 0")
        with self._lock:
            self._resize(pool, replicas, self._standby.get(pool, self._ray.status(pool).standby_target),
                         lambda: self._ray.scale_to(pool, replicas))

    def set_standby(self, pool: str, replicas: int) -> None:
        """Standby replicas are pods of the group too (one per replica): pods first on the way up,
        after they are released on the way down (a standby has nothing to drain)."""
        if replicas < 0:
            raise ValueError(f"set_standby({pool!r}, {replicas}): replicas must be >= 0")
        with self._lock:
            self._resize(pool, self._ray.status(pool).desired, replicas, lambda: self._ray.set_standby(pool, replicas))
            self._standby[pool] = replicas

    def _resize(self, pool: str, replicas: int, standby: int, apply: Callable[[], None]) -> None:
        pods = self._pods.setdefault(pool, self._ray.status(pool).desired + self._standby.get(pool, 0))
        want = replicas + standby
        if want > pods:  # pods first: room for the new actors
            self._kube.scale_to(pool, want)
            self._pods[pool] = want
        apply()  # on the way down: the victims start draining (standby ones are released at once)
        if want < self._pods[pool]:
            self._shrink[pool] = want
            self._settle(pool, self._ray.status(pool))
        else:
            self._shrink.pop(pool, None)  # a scale-up superseded a shrink still waiting for drains

    def _settle(self, pool: str, status: PoolStatus) -> None:
        """Shrink the pool's group once none of its replicas drains or starts (a starting replica's
        pod is not known yet), naming the pods that host no replica of the pool."""
        target = self._shrink.get(pool)
        if target is None or status.draining or status.starting:
            return
        victims = self._idle_pods(pool, self._pods[pool] - target)
        self._kube.resize(pool, target, victims)
        self._pods[pool] = target
        del self._shrink[pool]
        logger.info("kuberay actuator: pool %s drained; worker group resized to %d pods (deleting %s)", pool, target,
                    ", ".join(victims) or "pods KubeRay picks")

    def _idle_pods(self, pool: str, n: int) -> list[str]:
        """Up to n pods of the group hosting no replica of the pool: unschedulable first, then
        starting, then ready ones."""
        if self._hosts is None or n <= 0:
            return []
        used = self._hosts(pool)
        rank = {"pending": 0, "starting": 1, "ready": 2}
        idle = sorted(((rank[state], name) for name, ip, state in self._kube.pods(pool)
                       if state in rank and ip not in used), key=lambda x: x[0])
        if len(idle) < n:
            logger.warning("kuberay actuator: pool %s: only %d of the %d pods to remove host no replica; KubeRay "
                           "picks the rest (a replica there restarts elsewhere)", pool, len(idle), n)
        return [name for _, name in idle[:n]]


def make_actuator(a: AutoscalingSection, pools: Sequence[Any], controller: Any, *,
                  kube_factory: Callable[..., Any] | None = None) -> PoolActuator:
    """The actuator ``autoscaling.actuator`` names, over ``duet serve``'s pools and controller.
    kube_factory(cluster=, namespace=) builds the KubeRayActuator (default: from the pod's service
    account or the kubeconfig, ``KubeRayActuator.from_environment``)."""
    from cluster.deploy.ray_actuator import RayActuator

    ray = RayActuator(pools, controller, drain_grace_s=a.drain_grace_s)
    if a.actuator == "ray":
        return ray
    if kube_factory is None:
        from cluster.deploy.k8s_actuator import KubeRayActuator

        kube_factory = KubeRayActuator.from_environment
    namespace = a.kubernetes.namespace or _own_namespace()
    logger.info("duet: autoscaling resizes RayCluster %s/%s worker groups", namespace, a.kubernetes.raycluster)
    return KubeRayPoolActuator(ray, kube_factory(cluster=a.kubernetes.raycluster, namespace=namespace),
                               hosts=lambda pool: replica_hosts(controller, pool))


def replica_hosts(controller: Any, pool: str) -> set[str]:
    """The hosts (node IPs; on Kubernetes the pods' IPs) of the pool's replicas' endpoints."""
    return {str(row["endpoint"]).rsplit(":", 1)[0].strip("[]") for row in controller.describe()
            if row["pool"] == pool and row["endpoint"]}


def _own_namespace(path: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    from cluster.config.sources import ClusterConfigError

    try:
        return path.read_text().strip()
    except OSError:
        raise ClusterConfigError(
            f"autoscaling.kubernetes.namespace is empty and this is not a Kubernetes pod ({path} is missing); "
            "set the RayCluster's namespace") from None
