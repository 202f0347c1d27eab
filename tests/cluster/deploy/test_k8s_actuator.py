"""KubeRayActuator with the real ``kubernetes`` client against a local stand-in for the three API
calls it makes (GET RayCluster, JSON-PATCH RayCluster, list pods), served by http.server on
127.0.0.1. No Kubernetes API server runs here; the stand-in applies JSON patches with the API
server's rules that matter (``test`` ops, a stale resourceVersion -> 409 Conflict)."""

from __future__ import annotations

import copy
import inspect
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client as k8s

from cluster.autoscale.actuator import PoolActuator, PoolStatus
from cluster.deploy.k8s_actuator import K8sActuatorError, KubeRayActuator

NS, CLUSTER = "serving", "prod-duet"
RC_PATH = f"/apis/ray.io/v1/namespaces/{NS}/rayclusters/{CLUSTER}"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"


def _raycluster() -> dict:
    groups = [{"groupName": "serve", "replicas": 1, "minReplicas": 1, "maxReplicas": 4},
              {"groupName": "cpu-drafters", "replicas": 2, "minReplicas": 0, "maxReplicas": 8}]
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": CLUSTER, "namespace": NS, "resourceVersion": "100"},
            "spec": {"workerGroupSpecs": groups}}


def _pod(name: str, group: str, phase: str, conditions: list[dict] | None = None, deleting: bool = False,
         ip: str | None = None) -> dict:
    meta = {"name": name, "namespace": NS, "labels": {"ray.io/cluster": CLUSTER, "ray.io/group": group}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T20:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions or [], **({"podIP": ip} if ip else {})}}


class FakeApiServer:
    """Holds one RayCluster and some pods; ``failures`` is a queue of HTTP statuses to answer the
    next requests with (before normal handling); ``on_get`` runs after each RayCluster GET."""

    def __init__(self) -> None:
        self.raycluster = _raycluster()
        self.pods: list[dict] = []
        self.failures: list[int] = []
        self.requests: list[dict] = []
        self.on_get = None
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def calls(self, method: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method]

    def bump(self, **group_changes: int) -> None:
        """Another writer changes the object (new resourceVersion)."""
        rc = self.raycluster
        rc["metadata"]["resourceVersion"] = str(int(rc["metadata"]["resourceVersion"]) + 1)
        for name, replicas in group_changes.items():
            next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name)["replicas"] = replicas

    def _handle(self, method: str, path: str, query: dict, headers: dict, body: bytes) -> tuple[int, dict]:
        with self._lock:
            record = {"method": method, "path": path, "query": query, "content_type": headers.get("Content-Type"),
                      "body": json.loads(body) if body else None}
            self.requests.append(record)
            if self.failures:
                status = self.failures.pop(0)
                return status, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                                "message": f"injected {status}"}
            if path == RC_PATH and method == "GET":
                answer = copy.deepcopy(self.raycluster)
                if self.on_get is not None:
                    self.on_get()
                return 200, answer
            if path == RC_PATH and method == "PATCH":
                return self._patch(record["body"])
            if path == PODS_PATH and method == "GET":
                wanted = dict(kv.split("=") for kv in query["labelSelector"][0].split(","))
                items = [p for p in self.pods if wanted.items() <= p["metadata"]["labels"].items()]
                return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
            return 404, {"kind": "Status", "code": 404, "message": f"{path} not found"}

    def _patch(self, ops: list[dict]) -> tuple[int, dict]:
        obj = copy.deepcopy(self.raycluster)
        for op in ops:
            *parents, last = [int(p) if p.isdigit() else p for p in op["path"].strip("/").split("/")]
            node = obj
            for p in parents:
                node = node[p]
            if op["op"] == "test" and node[last] != op["value"]:
                return 422, {"kind": "Status", "code": 422, "message": f"test failed at {op['path']}"}
            if op["op"] in ("replace", "add"):
                node[last] = op["value"]
        current = self.raycluster["metadata"]["resourceVersion"]
        if obj["metadata"]["resourceVersion"] != current:  # the optimistic-concurrency precondition
            return 409, {"kind": "Status", "code": 409, "reason": "Conflict",
                         "message": "the object has been modified; please apply your changes to the latest version"}
        obj["metadata"]["resourceVersion"] = str(int(current) + 1)
        self.raycluster = obj
        return 200, obj

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlparse(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = server._handle(self.command, url.path, parse_qs(url.query), dict(self.headers), body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = _serve

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def sleeps():
    return []


@pytest.fixture
def actuator(api, sleeps):
    config = k8s.Configuration(host=api.url)
    return KubeRayActuator(k8s.ApiClient(config), CLUSTER, NS, max_attempts=3, backoff_s=0.5, sleep=sleeps.append)


def test_scale_to_sends_one_json_patch_to_the_groups_replicas(api, actuator):
    for method in ("scale_to", "status"):  # PoolActuator is a plain Protocol: compare the signatures
        assert inspect.signature(getattr(KubeRayActuator, method)) == inspect.signature(getattr(PoolActuator, method))
    actuator.scale_to("cpu_drafters", 5)  # pool name -> group name: "_" -> "-", as the chart names groups
    [patch] = api.calls("PATCH")
    assert patch["path"] == RC_PATH and patch["content_type"] == "application/json-patch+json"
    assert patch["body"] == [
        {"op": "test", "path": "/spec/workerGroupSpecs/1/groupName", "value": "cpu-drafters"},
        {"op": "replace", "path": "/metadata/resourceVersion", "value": "100"},
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 5},
    ]
    groups = api.raycluster["spec"]["workerGroupSpecs"]
    assert [g["replicas"] for g in groups] == [1, 5]  # only that group changed


def test_conflict_rereads_and_retries_without_losing_the_other_change(api, actuator, sleeps):
    def concurrent_writer():  # right after our first read, someone else scales "serve"
        api.on_get = None
        api.bump(serve=3)
    api.on_get = concurrent_writer
    actuator.scale_to("cpu_drafters", 4)
    patches = api.calls("PATCH")
    assert len(patches) == 2 and len(api.calls("GET")) == 2 and sleeps == [0.5]
    assert patches[0]["body"][1]["value"] == "100" and patches[1]["body"][1]["value"] == "101"
    assert [g["replicas"] for g in api.raycluster["spec"]["workerGroupSpecs"]] == [3, 4]


def test_server_errors_are_retried_with_backoff(api, actuator, sleeps):
    api.failures = [500]  # on the GET
    assert actuator.status("serve").desired == 1
    api.failures = [503, 429]  # the GET, then the next GET
    actuator.scale_to("serve", 2)
    assert api.raycluster["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    assert sleeps == [0.5, 0.5, 1.0]  # per call: 0.5 s, then doubling


def test_gives_up_after_max_attempts_with_the_last_error(api, actuator, sleeps):
    api.on_get = lambda: api.failures.append(502)  # every PATCH after a good GET fails
    with pytest.raises(K8sActuatorError, match=r"patch RayCluster serving/prod-duet: still failing after 3 attempts "
                                               r"\(last: HTTP 502 .*injected 502\)"):
        actuator.scale_to("serve", 2)
    assert len(api.calls("PATCH")) == 3 and sleeps == [0.5, 1.0]
    assert api.raycluster["spec"]["workerGroupSpecs"][0]["replicas"] == 1


@pytest.mark.parametrize(("status", "words"), [
    (403, "forbidden (403); the service account needs get+patch on rayclusters.ray.io and list on pods"),
    (404, "not found (404); check the RayCluster name ('prod-duet'"),
])
def test_403_and_404_are_clear_errors_not_retried(api, actuator, sleeps, status, words):
    api.failures = [status]
    with pytest.raises(K8sActuatorError, match=re.escape(words)):
        actuator.scale_to("serve", 2)
    assert len(api.requests) == 1 and sleeps == []


def test_unknown_pool_and_out_of_bounds_replicas(api, actuator):
    with pytest.raises(KeyError, match="no worker group 'decode' \\(groups: serve, cpu-drafters\\)"):
        actuator.status("decode")
    with pytest.raises(ValueError, match=r"outside worker group 'serve' bounds minReplicas..maxReplicas = 1..4"):
        actuator.scale_to("serve", 9)
    assert api.calls("PATCH") == []


def test_status_counts_pods_by_state(api, actuator):
    ready = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]
    api.pods = [
        _pod("s-0", "serve", "Running", ready),
        _pod("s-1", "serve", "Running", [{"type": "Ready", "status": "False"}]),  # Ray still starting
        _pod("s-2", "serve", "Pending", [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": "0/3 nodes are available: 3 Insufficient cpu."}]),
        _pod("s-3", "serve", "Pending", [{"type": "PodScheduled", "status": "True"}]),  # pulling the image
        _pod("s-4", "serve", "Running", ready, deleting=True),
        _pod("s-5", "serve", "Failed"),
        _pod("d-0", "cpu-drafters", "Running", ready),  # another group: not selected
    ]
    api.bump(serve=4)
    status = actuator.status("serve")
    assert status == PoolStatus(pool="serve", desired=4, ready=1, starting=2, pending=1, draining=1)
    assert status.capacity_replicas == 3
    [pods_call] = api.calls("GET")[-1:]
    assert pods_call["path"] == PODS_PATH
    assert pods_call["query"]["labelSelector"] == ["ray.io/cluster=prod-duet,ray.io/group=serve"]



def test_resize_names_the_pods_to_delete_and_pods_lists_names_and_ips(api, actuator):
    """What KubeRayPoolActuator uses to remove the drained pod, not one KubeRay picks: the group's
    scaleStrategy.workersToDelete in the same resourceVersion-guarded patch as the replicas."""
    ready = [{"type": "Ready", "status": "True"}]
    api.pods = [_pod("serve-a", "serve", "Running", ready, ip="10.0.0.1"), _pod("serve-b", "serve", "Running", ready, ip="10.0.0.2"),
                _pod("serve-c", "serve", "Pending")]
    assert actuator.pods("serve") == [("serve-a", "10.0.0.1", "ready"), ("serve-b", "10.0.0.2", "ready"),
                                      ("serve-c", None, "starting")]
    api.raycluster["spec"]["workerGroupSpecs"][0]["replicas"] = 3
    actuator.resize("serve", 2, ["serve-b"])
    [patch] = api.calls("PATCH")
    assert patch["body"][2:] == [
        {"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 2},
        {"op": "add", "path": "/spec/workerGroupSpecs/0/scaleStrategy", "value": {"workersToDelete": ["serve-b"]}}]
    group = api.raycluster["spec"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["scaleStrategy"]) == (2, {"workersToDelete": ["serve-b"]})
    actuator.resize("serve", 1, ["serve-a"])  # a second shrink replaces the list
    assert api.calls("PATCH")[1]["body"][3]["op"] == "replace"
    assert api.raycluster["spec"]["workerGroupSpecs"][0]["scaleStrategy"] == {"workersToDelete": ["serve-a"]}
