"""``autoscaling.actuator`` selection (cluster/deploy/kuberay_actuator.py make_actuator), its config
errors, and KubeRayPoolActuator's ordering of pod and actor changes: pods before actors on the way
up, the group shrunk only after the drains finish on the way down. The KubeRayActuator itself is
tested against an HTTP stand-in for the API server in test_k8s_actuator.py; here both halves are
recording fakes."""

from __future__ import annotations

import json

import pytest

from cluster.autoscale.actuator import PoolStatus
from cluster.config.duet import ClusterConfigError, load_config
from cluster.deploy.kuberay_actuator import KubeRayPoolActuator, _own_namespace, make_actuator, replica_hosts
from cluster.deploy.ray_actuator import RayActuator

PROFILE = {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "decode",
           "slo": {"tpot_p90_s": 0.1}, "capacity": {"requests_per_s": 2.0, "mean_output_tokens": 50.0}}


class FakeRay:
    """A RayActuator stand-in: ``draining`` replicas stay until the test clears them."""

    def __init__(self, log: list, size: int) -> None:
        self.log, self.desired, self.draining, self.starting = log, size, 0, 0

    def status(self, pool: str) -> PoolStatus:
        return PoolStatus(pool, self.desired, self.desired - self.starting, self.starting, 0, self.draining)

    def scale_to(self, pool: str, n: int) -> None:
        self.draining += max(0, self.desired - n)
        self.desired = n
        self.log.append(("ray", n))

    def set_standby(self, pool: str, n: int) -> None:
        self.log.append(("standby", n))


class FakeKube:
    """A KubeRayActuator stand-in: ``group`` is its pods as (name, IP, state); ``deleted`` the
    workersToDelete of each resize."""

    def __init__(self, log: list, group: list | None = None) -> None:
        self.log, self.group, self.deleted = log, group or [], []

    def scale_to(self, pool: str, n: int) -> None:
        self.resize(pool, n)

    def resize(self, pool: str, n: int, workers_to_delete=()) -> None:
        self.log.append(("pods", n))
        self.deleted.append(list(workers_to_delete))

    def pods(self, pool: str) -> list:
        return self.group


def test_up_adds_pods_before_actors_and_down_shrinks_the_group_only_after_the_drain():
    log: list = []
    ray = FakeRay(log, size=2)
    a = KubeRayPoolActuator(ray, FakeKube(log))
    a.scale_to("decode", 4)
    assert log == [("pods", 4), ("ray", 4)]
    log.clear()
    a.scale_to("decode", 1)
    assert log == [("ray", 1)] and ray.draining == 3  # pods kept while the victims drain
    a.status("decode")
    assert log == [("ray", 1)]
    ray.draining = 0  # the drains finished
    assert a.status("decode") == PoolStatus("decode", 1, 1, 0, 0, 0)
    assert log == [("ray", 1), ("pods", 1)]
    a.status("decode")
    assert log == [("ray", 1), ("pods", 1)]  # applied once


def test_a_scale_up_during_a_drain_cancels_the_shrink_and_never_removes_pods():
    log: list = []
    ray = FakeRay(log, size=4)
    a = KubeRayPoolActuator(ray, FakeKube(log))
    a.scale_to("decode", 2)
    a.scale_to("decode", 3)  # the shrink now waits to go to 3 pods, not 2
    ray.draining = 0
    a.status("decode")
    assert log == [("ray", 2), ("ray", 3), ("pods", 3)]
    log.clear()
    a.scale_to("decode", 1)
    a.scale_to("decode", 3)  # back to the group's size while draining: no patch at all, now or later
    ray.draining = 0
    a.status("decode")
    assert log == [("ray", 1), ("ray", 3)]
    a.scale_to("decode", 5)
    assert log[-2:] == [("pods", 5), ("ray", 5)]
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        a.scale_to("decode", -1)


def test_the_shrink_names_pods_hosting_no_replica_and_waits_for_starting_replicas():
    log: list = []
    ray = FakeRay(log, size=4)
    kube = FakeKube(log, [("p-a", "10.0.0.1", "ready"), ("p-b", "10.0.0.2", "ready"), ("p-c", "10.0.0.3", "ready"),
                          ("p-d", None, "pending"), ("p-e", "10.0.0.5", "draining")])
    hosts = {"10.0.0.1", "10.0.0.3"}  # the replicas left after the drain
    a = KubeRayPoolActuator(ray, kube, hosts=lambda pool: hosts)
    a.scale_to("decode", 2)
    ray.draining, ray.starting = 0, 1
    a.status("decode")
    assert kube.deleted == []  # a replica still starting: its pod is not known yet
    ray.starting = 0
    a.status("decode")
    assert log[-1] == ("pods", 2) and kube.deleted == [["p-d", "p-b"]]  # unschedulable first, then idle ready
    kube.deleted.clear()
    hosts = {"10.0.0.1", "10.0.0.2"}
    kube.group = [("p-a", "10.0.0.1", "ready"), ("p-b", "10.0.0.2", "ready")]
    a.scale_to("decode", 1)
    ray.draining = 0
    a.status("decode")
    assert kube.deleted == [[]]  # no pod is idle: KubeRay picks (logged)


def test_replica_hosts_are_the_endpoints_hosts():
    class Controller:
        def describe(self):
            return [{"pool": "decode", "endpoint": "10.0.0.7:5001"}, {"pool": "decode", "endpoint": None},
                    {"pool": "decode", "endpoint": "[fd00::1]:5002"}, {"pool": "prefill", "endpoint": "10.0.0.9:1"}]
    assert replica_hosts(Controller(), "decode") == {"10.0.0.7", "fd00::1"}


@pytest.fixture
def config_file(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))

    def write(extra: str) -> str:
        path = tmp_path / "duet.yaml"
        path.write_text(f"""
pools:
  - {{name: decode, role: colocated, replicas: 2}}
autoscaling:
  enabled: true
  metrics_urls: [http://duet-router:9090/metrics]
  pools:
    - {{pool: decode, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: {tmp_path / 'p.json'}, max_replicas: 4}}
{extra}
""")
        return str(path)
    return write


def test_selection_builds_the_actuator_the_config_names(config_file, tmp_path):
    ray_cfg = load_config(config_file(""), env={}).autoscaling
    assert ray_cfg.actuator == "ray"
    assert isinstance(make_actuator(ray_cfg, [], controller=None), RayActuator)

    k8s_cfg = load_config(config_file("  actuator: kubernetes\n  kubernetes: {raycluster: prod-duet, namespace: serving}"),
                          env={}).autoscaling
    made = []
    actuator = make_actuator(k8s_cfg, [], controller=None, kube_factory=lambda **kw: made.append(kw) or FakeKube([]))
    assert isinstance(actuator, KubeRayPoolActuator)
    assert made == [{"cluster": "prod-duet", "namespace": "serving"}]

    (tmp_path / "ns").write_text("team-a\n")
    assert _own_namespace(tmp_path / "ns") == "team-a"
    with pytest.raises(ClusterConfigError, match="namespace is empty and this is not a Kubernetes pod"):
        _own_namespace(tmp_path / "missing")


@pytest.mark.parametrize("extra, message", [
    ("  actuator: kubectl", r"autoscaling.actuator='kubectl' .*must be one of ray, kubernetes"),
    ("  actuator: kubernetes", r"autoscaling.kubernetes.raycluster='' .*must name the RayCluster"),
    ("  actuator: kubernetes\n  kubernetes: {raycluster: Prod_Duet}", r"raycluster='Prod_Duet' .*must name the RayCluster"),
    ("  actuator: kubernetes\n  kubernetes: {raycluster: d, namespace: 'a b'}",
     r"autoscaling.kubernetes.namespace='a b' .*must be a Kubernetes namespace name"),
    ("  kubernetes: {raycluster: prod-duet}", r"raycluster='prod-duet' .*only read with actuator: kubernetes"),
])
def test_actuator_config_errors_name_the_key_and_the_fix(config_file, extra, message):
    with pytest.raises(ClusterConfigError, match=message):
        load_config(config_file(extra), env={})


def test_standby_replicas_are_pods_of_the_group_too():
    log: list = []
    a = KubeRayPoolActuator(FakeRay(log, size=2), FakeKube(log))
    a.set_standby("decode", 1)
    assert log == [("pods", 3), ("standby", 1)]  # a pod for the standby before the actor
    a.scale_to("decode", 3)  # the serving replicas and the standby together
    assert log[2:] == [("pods", 4), ("ray", 3)]
    a.set_standby("decode", 0)  # released at once (nothing to drain): the group shrinks after
    assert log[4:] == [("standby", 0), ("pods", 3)]
