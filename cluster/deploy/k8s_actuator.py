"""KubeRayActuator: a PoolActuator (cluster/autoscale/actuator.py) that resizes KubeRay worker groups.

For clusters where KubeRay's in-tree Ray autoscaler is off (the Helm chart's
``autoscaling.enableInTreeAutoscaling: false``): Duet's autoscaler decides, this applies, through
the Kubernetes API with the ``kubernetes`` client (``pip install 'duetserve[k8s]'``).

Terms:
    cluster     the RayCluster object (``ray.io/v1``, plural ``rayclusters``); the chart names it
                ``<release>-duet`` (the helm "fullname").
    group       a worker group, ``spec.workerGroupSpecs[i]``; the chart names it after the pool with
                ``_`` -> ``-`` (``cpu_drafters`` -> ``cpu-drafters``), the default mapping here.

``scale_to(pool, n)`` reads the RayCluster, finds the group by name and sends a JSON patch::

    [{"op": "test",    "path": "/spec/workerGroupSpecs/1/groupName", "value": "decode"},
     {"op": "replace", "path": "/metadata/resourceVersion",          "value": "<as read>"},
     {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas",  "value": 3}]

``resize(pool, n, workers_to_delete=[pod, ...])`` adds
``{"op": "replace", "path": "/spec/workerGroupSpecs/1/scaleStrategy", "value": {"workersToDelete": [...]}}``
(what Ray's own autoscaler sends): KubeRay deletes the named pods first. ``pods(pool)`` lists the
group's pods as (name, IP, state).

The ``test`` guards the index; carrying the resourceVersion read makes the API server refuse the
write with 409 Conflict if anyone (KubeRay, kubectl, another autoscaler) changed the object in
between, and the actuator then reads again and retries -- it never overwrites a change it did not see.
409, 429 and 5xx are retried with exponential backoff (``max_attempts`` in all); 403 and 404 raise
``K8sActuatorError`` saying which permission or object is missing. ``n`` outside the group's
``minReplicas..maxReplicas`` is a ``ValueError`` (the bounds are the operator's, not ours to move).

``status(pool)`` lists the group's pods by the labels KubeRay sets (``ray.io/cluster``,
``ray.io/group``) and counts them: Running and Ready -> ready; Pending with a PodScheduled=False
condition whose reason is Unschedulable -> pending (no node has room; never counted as capacity);
being deleted -> draining; any other Pending or not-yet-Ready Running pod -> starting. Finished
pods (Succeeded/Failed) are not counted (KubeRay replaces them). "Ready" is Kubernetes' view: the
Ray node is up; the Duet worker on it may still be loading its model.

Scaling down: ``scale_to`` lets KubeRay delete pods of its own choosing; ``resize`` names them.
``duet serve`` never uses this class alone: with ``autoscaling.actuator: kubernetes`` it wraps it in
cluster/deploy/kuberay_actuator.py, which drains the Duet replicas first and then shrinks the group
naming the pods left idle; what that does and does not guarantee is documented there.

Permissions (a Role in the cluster's namespace): ``get`` and ``patch`` on ``rayclusters.ray.io``,
``list`` on ``pods``.

No Kubernetes API server runs in this repository's tests: tests/cluster/deploy/test_k8s_actuator.py drives
the real client against a local HTTP server that answers the three calls this module makes.

Example::

    actuator = KubeRayActuator.from_environment(cluster="prod-duet", namespace="serving")
    actuator.scale_to("decode", 4)
    actuator.status("decode")   # PoolStatus(pool='decode', desired=4, ready=2, starting=1, pending=1, draining=0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes import client as k8s

from cluster.autoscale.actuator import PoolStatus

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
RETRYABLE = {409, 429, 500, 502, 503, 504}


class K8sActuatorError(RuntimeError):
    """The Kubernetes API refused or kept failing; the message says what to check."""


class KubeRayActuator:
    """Resize and observe one RayCluster's worker groups (see the module docstring)."""

    def __init__(self, api_client: k8s.ApiClient, cluster: str, namespace: str, *,
                 groups: Mapping[str, str] | None = None, max_attempts: int = 5, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> None:
        assert max_attempts >= 1 and backoff_s >= 0
        self._custom = k8s.CustomObjectsApi(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self.cluster, self.namespace = cluster, namespace
        self._groups = dict(groups or {})
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self._sleep = sleep

    @classmethod
    def from_environment(cls, cluster: str, namespace: str, **kwargs: Any) -> KubeRayActuator:
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        from kubernetes import config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(k8s.ApiClient(), cluster, namespace, **kwargs)

    def group_of(self, pool: str) -> str:
        return self._groups.get(pool, pool.replace("_", "-"))

    # ------------------------------------------------------------------------------ PoolActuator
    def scale_to(self, pool: str, replicas: int) -> None:
        self.resize(pool, replicas)

    def resize(self, pool: str, replicas: int, workers_to_delete: Sequence[str] = ()) -> None:
        """``scale_to``, and with ``workers_to_delete`` (pod names of the group) also sets the group's
        ``scaleStrategy.workersToDelete``: KubeRay deletes those pods first, then others of its
        choosing only if the group still has more pods than ``replicas``."""
        if replicas < 0:
            raise ValueError(f"scale_to({pool!r}, {replicas}): replicas must be >= 0")
        for attempt in range(1, self.max_attempts + 1):
            index, group, version = self._find_group(pool)
            low, high = group.get("minReplicas", 0), group.get("maxReplicas", replicas)
            if not low <= replicas <= high:
                raise ValueError(f"scale_to({pool!r}, {replicas}): outside worker group {group['groupName']!r} bounds "
                                 f"minReplicas..maxReplicas = {low}..{high} (change them in the chart values)")
            base = f"/spec/workerGroupSpecs/{index}"
            patch = [{"op": "test", "path": f"{base}/groupName", "value": group["groupName"]},
                     {"op": "replace", "path": "/metadata/resourceVersion", "value": version},
                     {"op": "replace" if "replicas" in group else "add", "path": f"{base}/replicas", "value": replicas}]
            if workers_to_delete:
                patch.append({"op": "replace" if "scaleStrategy" in group else "add", "path": f"{base}/scaleStrategy",
                              "value": {"workersToDelete": list(workers_to_delete)}})
            try:
                self._custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.cluster, patch,
                                                            _content_type="application/json-patch+json")
            except k8s.ApiException as e:
                self._raise_unless_retryable(e, f"patch RayCluster {self._where}", attempt)
                self._backoff(attempt, e)
                continue
            logger.info("k8s: %s worker group %s: replicas %s -> %d%s", self._where, group["groupName"],
                        group.get("replicas"), replicas, f" (deleting {', '.join(workers_to_delete)})"
                        if workers_to_delete else "")
            return

    def pods(self, pool: str) -> list[tuple[str, str | None, str | None]]:
        """(name, pod IP, state as ``status`` counts it) of each pod of the pool's group."""
        return self._pods(self._find_group(pool)[1])

    def _pods(self, group: dict[str, Any]) -> list[tuple[str, str | None, str | None]]:
        selector = f"ray.io/cluster={self.cluster},ray.io/group={group['groupName']}"
        items = self._call(lambda: self._core.list_namespaced_pod(self.namespace, label_selector=selector),
                           f"list pods ({selector}) in namespace {self.namespace}").items
        return [(pod.metadata.name, pod.status.pod_ip if pod.status else None, classify_pod(pod)) for pod in items]

    def status(self, pool: str) -> PoolStatus:
        _, group, _ = self._find_group(pool)
        counts = {"ready": 0, "starting": 0, "pending": 0, "draining": 0}
        for _, _, state in self._pods(group):
            if state is not None:
                counts[state] += 1
        return PoolStatus(pool=pool, desired=int(group.get("replicas", 0)), **counts)

    # ------------------------------------------------------------------------------ internals
    @property
    def _where(self) -> str:
        return f"{self.namespace}/{self.cluster}"

    def _find_group(self, pool: str) -> tuple[int, dict[str, Any], str]:
        """(index, group spec, resourceVersion) of the pool's worker group; KeyError if absent."""
        obj = self._call(lambda: self._custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                                           self.cluster), f"get RayCluster {self._where}")
        name = self.group_of(pool)
        groups = obj.get("spec", {}).get("workerGroupSpecs", [])
        for index, group in enumerate(groups):
            if group.get("groupName") == name:
                return index, group, obj["metadata"]["resourceVersion"]
        raise KeyError(f"pool {pool!r}: RayCluster {self._where} has no worker group {name!r} "
                       f"(groups: {', '.join(g.get('groupName', '?') for g in groups) or 'none'})")

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except k8s.ApiException as e:
                self._raise_unless_retryable(e, what, attempt)
                self._backoff(attempt, e)
        raise AssertionError("unreachable")

    def _raise_unless_retryable(self, e: k8s.ApiException, what: str, attempt: int) -> None:
        status = e.status or 0
        if status == 403:
            raise K8sActuatorError(f"{what}: forbidden (403); the service account needs get+patch on "
                                   f"rayclusters.ray.io and list on pods in namespace {self.namespace}") from None
        if status == 404:
            raise K8sActuatorError(f"{what}: not found (404); check the RayCluster name ({self.cluster!r}, the "
                                   f"chart's <release>-duet) and namespace ({self.namespace!r}), and that "
                                   "KubeRay's CRDs are installed") from None
        if status not in RETRYABLE:
            raise K8sActuatorError(f"{what}: HTTP {status} {e.reason}: {_message(e)}") from None
        if attempt >= self.max_attempts:
            raise K8sActuatorError(f"{what}: still failing after {attempt} attempts "
                                   f"(last: HTTP {status} {e.reason}: {_message(e)})") from None

    def _backoff(self, attempt: int, e: k8s.ApiException) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        logger.warning("k8s: HTTP %s on %s (attempt %d/%d); retrying in %.2f s", e.status, self._where, attempt,
                       self.max_attempts, delay)
        self._sleep(delay)


def classify_pod(pod: Any) -> str | None:
    """'ready' | 'starting' | 'pending' | 'draining', or None for a finished pod (see module doc)."""
    if pod.metadata.deletion_timestamp is not None:
        return "draining"
    phase = pod.status.phase if pod.status else None
    conditions = {c.type: c for c in (pod.status.conditions or [])} if pod.status else {}
    if phase in ("Succeeded", "Failed"):
        return None
    if phase == "Running" and getattr(conditions.get("Ready"), "status", None) == "True":
        return "ready"
    scheduled = conditions.get("PodScheduled")
    if phase == "Pending" and scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
        return "pending"
    return "starting"


def _message(e: k8s.ApiException) -> str:
    """The API server's Status.message if the body is one, else the raw body (shortened)."""
    import json

    body = e.body.decode() if isinstance(e.body, bytes) else (e.body or "")
    try:
        return json.loads(body).get("message", body)[:300]
    except (ValueError, AttributeError):
        return body[:300]
