"""The Helm chart (deploy/helm/duet) rendered by the real helm for the default values and three
variants (ci/colocated, ci/disaggregated with CPU drafters, ci/moe with EP):

* ``helm lint --strict`` passes;
* every core object validates against the Kubernetes 1.35 OpenAPI schema (kubernetes-validate
  --strict: unknown fields are errors), and so does every RayCluster pod template (as a PodTemplate);
* the RayCluster holds to the subset of KubeRay's ray.io/v1 CRD listed in KUBERAY_* below;
* the ConfigMap's duet.yaml loads with Duet's own loader (cluster.config.load_config), and what it
  says matches the objects (ports, probes, the router's --membership target, worker groups);
* bad values fail the render with a message naming the value (schema or the chart's checks);
* values the code does not use yet are listed in NOTES.

No Kubernetes API server runs here: these are render-time checks.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helm_tools import CHART, NAMESPACE, RELEASE, render, run_helm

from cluster.config import load_config

K8S_VERSION = "1.35.0"  # helm 4.1.4's client version; kubernetes-validate 1.37.0 ships its schemas
VARIANTS = {"default": None, **{p.stem: p for p in sorted((CHART / "ci").glob("*-values.yaml"))}}
CORE_KINDS = {"ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"}
FULLNAME = f"{RELEASE}-duet"

# The subset of KubeRay's RayCluster CRD (ray.io/v1) this chart relies on; keys outside these sets
# would be dropped or rejected by the API server.
KUBERAY_SPEC = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
                "headServiceAnnotations", "suspend", "gcsFaultToleranceOptions", "managedBy", "upgradeStrategy"}
KUBERAY_AUTOSCALER = {"upscalingMode", "idleTimeoutSeconds", "resources", "image", "imagePullPolicy",
                      "securityContext", "env", "envFrom", "volumes", "volumeMounts", "version"}
KUBERAY_UPSCALING_MODES = {"Default", "Aggressive", "Conservative"}
KUBERAY_HEAD = {"rayStartParams", "template", "serviceType", "headService", "enableIngress", "suspend"}
KUBERAY_WORKER = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template", "numOfHosts",
                  "scaleStrategy", "suspend", "idleTimeoutSeconds"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, helm):
    values_file = VARIANTS[request.param]
    objects = render(helm, values_file)
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    return request.param, values_file, by_kind


def _one(by_kind: dict[str, list[dict]], kind: str, name: str | None = None) -> dict:
    objs = [o for o in by_kind.get(kind, []) if name is None or o["metadata"]["name"] == name]
    assert len(objs) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in objs]}"
    return objs[0]


def _merged(base: dict, override: dict) -> dict:
    """Helm's coalescing of a values file over values.yaml: maps merge, everything else replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def _loaded_config(by_kind, tmp_path):
    path = tmp_path / "duet.yaml"
    path.write_text(_one(by_kind, "ConfigMap")["data"]["duet.yaml"])
    return load_config(path, env={})


def test_lint(helm):
    for name, values_file in VARIANTS.items():
        args = ["lint", "--strict", str(CHART)] + (["-f", str(values_file)] if values_file else [])
        r = run_helm(helm, *args)
        assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"


def test_core_objects_and_pod_templates_validate(variant):
    name, _, by_kind = variant
    assert {"ConfigMap", "Deployment", "Service", "RayCluster"} <= set(by_kind)
    for kind, objs in by_kind.items():
        for obj in objs:
            if kind in CORE_KINDS:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            else:
                assert kind in {"RayCluster", "ServiceMonitor"}, f"{name}: unexpected kind {kind}"
    cluster = _one(by_kind, "RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for template in templates:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_raycluster_uses_only_documented_kuberay_fields(variant):
    name, _, by_kind = variant
    cluster = _one(by_kind, "RayCluster", FULLNAME)
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert set(spec) <= KUBERAY_SPEC, set(spec) - KUBERAY_SPEC
    assert isinstance(spec["rayVersion"], str) and isinstance(spec["enableInTreeAutoscaling"], bool)
    if spec["enableInTreeAutoscaling"]:
        assert set(spec["autoscalerOptions"]) <= KUBERAY_AUTOSCALER
        assert spec["autoscalerOptions"]["upscalingMode"] in KUBERAY_UPSCALING_MODES
        assert isinstance(spec["autoscalerOptions"]["idleTimeoutSeconds"], int)
    head = spec["headGroupSpec"]
    assert set(head) <= KUBERAY_HEAD
    assert head["template"]["spec"]["containers"][0]["name"] == "ray-head"  # KubeRay: the Ray container is first
    groups = spec["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups)
    for group in [head, *groups]:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in group["rayStartParams"].items()), \
            f"rayStartParams values must be strings: {group['rayStartParams']}"
    assert head["rayStartParams"]["num-cpus"] == "0"  # no worker actors on the head
    for g in groups:
        assert set(g) <= KUBERAY_WORKER, set(g) - KUBERAY_WORKER
        assert DNS_LABEL.match(g["groupName"]), g["groupName"]
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        container = g["template"]["spec"]["containers"][0]
        res = container["resources"]
        assert g["rayStartParams"]["num-cpus"] == str(res["requests"]["cpu"])
        gpus = res["limits"].get("nvidia.com/gpu")
        assert g["rayStartParams"].get("num-gpus") == gpus, "Ray must advertise the GPUs the pod gets"
        assert g["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # NetworkPolicy peer


def test_configmap_loads_with_duets_loader_and_matches_the_objects(variant, tmp_path):
    name, values_file, by_kind = variant
    config = _loaded_config(by_kind, tmp_path)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_file is not None:
        values = _merged(values, yaml.safe_load(values_file.read_text()))
    assert config.ray.address == "auto" and config.controller.host == "0.0.0.0" and config.router.host == "0.0.0.0"
    assert (config.model.name, config.model.dtype) == (values["model"]["name"], values["model"]["dtype"])
    assert (config.router.policy, config.router.max_queue) == (values["router"]["policy"], values["router"]["maxQueue"])

    cluster = _one(by_kind, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    controller = next(c for c in head["containers"] if c["name"] == "duet-controller")
    assert controller["command"][-1].endswith("duet serve --no-router")
    assert {e["name"]: e["value"] for e in controller["env"]}["DUET_CONFIG"] == "/etc/duet/duet.yaml"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert controller[probe]["grpc"] == {"port": config.controller.port, "service": "duet.control.v1.Membership"}
    startup = controller["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.controller.start_timeout_s + 60

    # Each served pool is a worker group of the same size; its pods' CPUs are the pool's cpus_per_replica.
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for pool in config.pools:
        group = groups[pool.name.replace("_", "-")]
        assert group["replicas"] == pool.replicas and group["rayStartParams"]["num-cpus"] == str(pool.cpus_per_replica)

    router = _one(by_kind, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0]
    membership = router["command"][router["command"].index("--membership") + 1]
    service = _one(by_kind, "Service", membership.split(":")[0])
    assert service["spec"]["selector"] == {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}
    assert int(membership.split(":")[1]) == config.controller.port == service["spec"]["ports"][0]["port"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["grpc"] == config.router.port
    if values["router"]["tls"]["secretName"]:  # kubelet's gRPC probes cannot do TLS: the healthcheck command
        command = router["readinessProbe"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "router.healthcheck"]
        assert command[command.index("--target") + 1] == f"127.0.0.1:{config.router.port}"
        live = router["livenessProbe"]["exec"]["command"]
        assert live[live.index("--service") + 1] == "duet.control.v1.RouterAdmin"
    else:
        assert router["readinessProbe"]["grpc"] == {"port": config.router.port}
        assert router["livenessProbe"]["grpc"]["service"] == "duet.control.v1.RouterAdmin"
    router_service = _one(by_kind, "Service", f"{FULLNAME}-router")
    assert {p["targetPort"] for p in router_service["spec"]["ports"]} <= set(ports)


def test_variant_specifics(variant, tmp_path):
    name, _, by_kind = variant
    config = _loaded_config(by_kind, tmp_path)
    groups = {g["groupName"]: g for g in _one(by_kind, "RayCluster")["spec"]["workerGroupSpecs"]}
    if name == "default":
        assert [p.name for p in config.pools] == ["default"] and "ServiceMonitor" not in by_kind
        assert {o["metadata"]["name"] for o in by_kind["NetworkPolicy"]} == {f"{FULLNAME}-ray", f"{FULLNAME}-router"}
    elif name == "colocated-values":
        assert config.pools[0].replicas == 4 and config.pools[0].engine.kv_cache_memory_bytes == 2 << 30
        assert config.router.policy == "least_loaded" and config.model.max_model_len == 4096
        assert (groups["serve"]["minReplicas"], groups["serve"]["maxReplicas"]) == (2, 8)
        # TLS + tokens reach the router as DUET_* env (not the shared ConfigMap); the loader takes them
        router = _one(by_kind, "Deployment")["spec"]["template"]["spec"]
        env = {e["name"]: e["value"] for e in router["containers"][0]["env"] if e["name"].startswith(("DUET_TLS", "DUET_AUTH"))}
        assert env == {"DUET_TLS_CERT_FILE": "/etc/duet/tls/tls.crt", "DUET_TLS_KEY_FILE": "/etc/duet/tls/tls.key",
                       "DUET_AUTH_TOKENS_FILE": "/etc/duet/auth/tokens"}
        mounts = {m["mountPath"]: m["name"] for m in router["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in router["volumes"]}
        for path in env.values():  # each file lives in a mounted Secret
            assert volumes[mounts[str(Path(path).parent)]]["secret"]["secretName"] in ("duet-router-tls", "duet-router-tokens")
        for path in env.values():  # stand-ins for the mounted files: the loader checks they exist
            (tmp_path / Path(path).name).write_text("x")
        cm = tmp_path / "duet.yaml"
        router_config = load_config(cm, env={k: str(tmp_path / Path(v).name) for k, v in env.items()})
        assert router_config.router.tls_cert_file.endswith("tls.crt") and router_config.router.auth_tokens_file
        monitor = _one(by_kind, "ServiceMonitor")
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert len(by_kind["PodDisruptionBudget"]) == 2  # routers + head
    elif name == "disaggregated-values":
        assert [p.name for p in config.pools] == ["serve"]  # prefill/decode/drafter: not in Duet's config yet
        assert set(groups) == {"serve", "prefill", "decode", "cpu-drafters"}
        for gpu_group in ("prefill", "decode"):
            spec = groups[gpu_group]["template"]["spec"]
            assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert "nvidia.com/gpu" not in groups["cpu-drafters"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert dict(config.router.policy_options) == {"balance_rel": 1.5}
    elif name == "moe-values":
        cluster = _one(by_kind, "RayCluster")
        assert cluster["spec"]["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster["spec"]
        assert groups["moe"]["rayStartParams"]["num-gpus"] == "4"
        volumes = {v["name"]: v for v in groups["moe"]["template"]["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "moe-weights"
        assert "NetworkPolicy" not in by_kind and "PodDisruptionBudget" not in by_kind
    else:
        raise AssertionError(f"new variant {name}: add its checks here")


def test_not_yet_used_values_are_reported_in_notes(helm):
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 "-f", str(VARIANTS["disaggregated-values"]))
    assert r.returncode == 0, r.stderr
    notes = r.stdout[r.stdout.index("NOTES:"):]
    assert "NOT YET USED" in notes
    for line in ("pools[prefill].role=prefill", "pools[decode].slo", "pools[cpu_drafters].role=drafter"):
        assert line in notes
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert r.returncode == 0 and "NOT YET USED" not in r.stdout and "duet generate --target" in r.stdout
    assert "request GPUs but image.variant" not in r.stdout
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "poolDefaults.gpusPerReplica=1")
    assert r.returncode == 0 and 'pools default request GPUs but image.variant is "cpu"' in r.stdout


@pytest.mark.parametrize(("sets", "message"), [
    (["poolDefaults.replicas=-1"], "at '/poolDefaults/replicas': minimum: got -1, want 0"),
    (["pools[0].name=default", "pools[0].role=expert"], "at '/pools/0/role': value must be one of"),
    (["pools[0].name=Default", "pools[0].role=colocated"], "at '/pools/0/name'"),
    (["router.port=70000"], "at '/router/port': maximum: got 70,000, want 65,535"),
    (["router.policy=fastest"], "at '/router/policy': value must be one of"),
    (["router.colour=blue"], "additional properties 'colour' not allowed"),
    (["model.dtype=int3"], "at '/model/dtype'"),
    (["poolDefaults.engine.kvCacheMemory=lots"], "at '/poolDefaults/engine/kvCacheMemory'"),
    (["pools[0].name=default", "pools[0].role=colocated", "pools[0].replicas=5", "pools[0].maxReplicas=2"],
     "pools[0] (default): replicas=5 must be between minReplicas=5 and maxReplicas=2"),
    (["pools[0].name=a", "pools[0].role=colocated", "pools[1].name=b", "pools[1].role=colocated"],
     "this Duet version serves exactly 1 pool(s) of role colocated; found 2"),
    (["pools[0].name=a", "pools[0].role=prefill"], "found 0 (add one with role: colocated"),
    (["pools[0].name=a", "pools[0].role=colocated", "pools[1].name=a", "pools[1].role=decode"],
     'pools[1].name="a": pool names must be unique'),
    (["serviceMonitor.enabled=true", "router.metrics.enabled=false"], "serviceMonitor.enabled=true needs"),
    (["pools[0].name=serve", "pools[0].role=colocated", "pools[0].replicas=0"],
     "pools (serve): replicas=0: a colocated pool serves with at least 1 worker"),
    (["poolDefaults.engine.maxNumSeqs=600"], "engine.maxNumSeqs=600 must be <= engine.maxNumBatchedTokens=512"),
    (["router.tls.secretName=tls"], "router.tls.serverName: required with router.tls.secretName"),
    (["router.tls.requireClientCerts=true"], "router.tls.requireClientCerts=true needs router.tls.secretName"),
    (["router.maxRequestBytes=lots"], "at '/router/maxRequestBytes'"),
])
def test_bad_values_are_rejected_with_a_clear_message(helm, sets, message):
    args = ["template", RELEASE, str(CHART)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
