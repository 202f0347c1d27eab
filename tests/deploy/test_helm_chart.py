"""The Helm chart (deploy/helm/duet) rendered by the real helm for the default values and every
worked example (ci/colocated, ci/disaggregated with CPU drafters, ci/moe with EP, ci/tp):

* ``helm lint --strict`` passes;
* every core object validates against the Kubernetes 1.35 OpenAPI schema (kubernetes-validate
  --strict: unknown fields are errors), and so does every RayCluster pod template (as a PodTemplate);
* the RayCluster holds to the subset of KubeRay's ray.io/v1 CRD listed in KUBERAY_* below, and
  Ray's own KubeRay autoscaler reads from it the resources each group's pods offer;
* the ConfigMap's duet.yaml loads with Duet's own loader (cluster.config.duet.load_config), and what it
  says matches the objects (ports, probes, the router's --membership target, worker groups, each
  pool's own Ray resource: Ray's autoscaler packs exactly one gang's rank bundles into a pod);
* values the code does not use yet are listed in NOTES.

Pools, gangs, speculative decoding and bad values: test_chart_pools.py.

No Kubernetes API server runs here: these are render-time checks.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from testkit.helm_tools import CHART, NAMESPACE, RELEASE, VARIANTS, by_kind, loaded_config, one, ray_node_types, render, run_helm

from cluster.config.duet import load_config

K8S_VERSION = "1.35.0"  # helm 4.1.4's client version; kubernetes-validate 1.37.0 ships its schemas
CORE_KINDS = {"ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "ServiceAccount", "Role",
              "RoleBinding"}
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
    return request.param, values_file, by_kind(render(helm, values_file))


def _merged(base: dict, override: dict) -> dict:
    """Helm's coalescing of a values file over values.yaml: maps merge, everything else replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


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
    cluster = one(by_kind, "RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for template in templates:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_raycluster_uses_only_documented_kuberay_fields(variant):
    name, _, by_kind = variant
    cluster = one(by_kind, "RayCluster", FULLNAME)
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
        assert set(g["rayStartParams"]) <= {"num-cpus", "num-gpus", "resources"}  # `ray start` options KubeRay passes on
        assert DNS_LABEL.match(g["groupName"]), g["groupName"]
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        container = g["template"]["spec"]["containers"][0]
        res = container["resources"]
        assert g["rayStartParams"]["num-cpus"] == str(res["requests"]["cpu"])
        gpus = res["limits"].get("nvidia.com/gpu")
        assert g["rayStartParams"].get("num-gpus") == gpus, "Ray must advertise the GPUs the pod gets"
        assert g["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # NetworkPolicy peer

    # Ray's own KubeRay autoscaler reads every group: the head offers no CPUs to actors, each worker
    # group offers what its pods get (custom resources parsed from the documented string form).
    node_types = ray_node_types(by_kind)
    assert node_types.pop("headgroup")["resources"]["CPU"] == 0
    assert set(node_types) == {g["groupName"] for g in groups}
    for g in groups:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        offered = node_types[g["groupName"]]
        assert offered["resources"]["CPU"] == int(g["rayStartParams"]["num-cpus"])
        assert offered["resources"].get("GPU", 0) == int(limits.get("nvidia.com/gpu", 0))
        assert (offered["min_workers"], offered["max_workers"]) == (g["minReplicas"], g["maxReplicas"])


def test_configmap_loads_with_duets_loader_and_matches_the_objects(variant, tmp_path):
    from ray.autoscaler._private.resource_demand_scheduler import get_bin_pack_residual

    from cluster.deploy.pools import rank_bundle

    name, values_file, by_kind = variant
    config = loaded_config(by_kind, tmp_path)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_file is not None:
        values = _merged(values, yaml.safe_load(values_file.read_text()))
    assert config.ray.address == "auto" and config.controller.host == "0.0.0.0" and config.router.host == "0.0.0.0"
    assert (config.model.name, config.model.dtype) == (values["model"]["name"], values["model"]["dtype"])
    assert (config.router.policy, config.router.max_queue) == (values["router"]["policy"], values["router"]["maxQueue"])

    cluster = one(by_kind, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    controller = next(c for c in head["containers"] if c["name"] == "duet-controller")
    assert controller["command"][-1].endswith("duet serve --no-router")
    assert {e["name"]: e["value"] for e in controller["env"]}["DUET_CONFIG"] == "/etc/duet/duet.yaml"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert controller[probe]["grpc"] == {"port": config.controller.port, "service": "duet.control.v1.Membership"}
    startup = controller["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.controller.start_timeout_s + 60

    # Every pool is a worker group with one pod per replica, labelled with the pool and its role; a
    # pod holds the replica's whole gang: gang_size bundles of cpus_per_replica CPUs.
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    node_types = ray_node_types(by_kind)
    assert set(groups) - {"drafters"} == {pool.name.replace("_", "-") for pool in config.pools}
    for pool in config.pools:
        group = groups[pool.name.replace("_", "-")]
        assert group["replicas"] == pool.replicas
        assert group["rayStartParams"]["num-cpus"] == str(pool.gang_size * pool.cpus_per_replica)
        # the pool's ranks ask for its own resource, and its pods offer one unit per rank slot
        assert dict(pool.resources_per_rank) == {f"duet_pool_{pool.name}": 1}
        offered = node_types[group["groupName"]]["resources"]
        assert offered[f"duet_pool_{pool.name}"] == pool.gang_size
        assert offered.get("GPU", 0) == pool.gang_size * pool.gpus_per_rank
        gang = [rank_bundle(pool) for _ in range(pool.gang_size)]  # Ray's autoscaler: one pod holds one gang
        assert get_bin_pack_residual([dict(offered)], gang)[0] == []
        assert get_bin_pack_residual([dict(offered)], [*gang, rank_bundle(pool)])[0] == [rank_bundle(pool)]
        labels = group["template"]["metadata"]["labels"]
        assert (labels["duet.ai/pool"], labels["duet.ai/role"]) == (pool.name, pool.role)
        # what each worker (or drafter replica) of the pool runs: the engine config validates too
        config.to_drafter_engine_config(pool) if pool.role == "drafter" else config.to_engine_config(pool)

    router = one(by_kind, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0]
    membership = router["command"][router["command"].index("--membership") + 1]
    service = one(by_kind, "Service", membership.split(":")[0])
    assert service["spec"]["selector"] == {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}
    assert int(membership.split(":")[1]) == config.controller.port == service["spec"]["ports"][0]["port"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["grpc"] == config.router.port
    # the OpenAI-compatible HTTP API: the config's port, a container port and a Service port named http
    assert ports["http"] == config.router.http_port == values["router"]["httpPort"] > 0
    router_service = one(by_kind, "Service", f"{FULLNAME}-router")["spec"]["ports"]
    assert {"name": "http", "port": config.router.http_port, "targetPort": "http"}.items() <= \
        next(p for p in router_service if p["name"] == "http").items()
    if values["router"]["tls"]["secretName"]:  # kubelet's gRPC probes cannot do TLS: the healthcheck command
        command = router["readinessProbe"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "router.healthcheck"]
        assert command[command.index("--target") + 1] == f"127.0.0.1:{config.router.port}"
        live = router["livenessProbe"]["exec"]["command"]
        assert live[live.index("--service") + 1] == "duet.control.v1.RouterAdmin"
    else:
        assert router["readinessProbe"]["grpc"] == {"port": config.router.port}
        assert router["livenessProbe"]["grpc"]["service"] == "duet.control.v1.RouterAdmin"
    router_service = one(by_kind, "Service", f"{FULLNAME}-router")
    assert {p["targetPort"] for p in router_service["spec"]["ports"]} <= set(ports)


def test_variant_specifics(variant, tmp_path):
    name, _, by_kind = variant
    config = loaded_config(by_kind, tmp_path)
    pools = {p.name: p for p in config.pools}
    groups = {g["groupName"]: g for g in one(by_kind, "RayCluster")["spec"]["workerGroupSpecs"]}
    pod = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"] for name, g in groups.items()}
    if name == "default":
        assert [(p.name, p.role, p.gang_size) for p in config.pools] == [("default", "colocated", 1)]
        assert config.pool.speculative.method == "none" and config.model.quantization == "none"
        assert "ServiceMonitor" not in by_kind and set(groups) == {"default"}
        assert {o["metadata"]["name"] for o in by_kind["NetworkPolicy"]} == {f"{FULLNAME}-ray", f"{FULLNAME}-router"}
        # Duet's SLO autoscaler on by default: the default pool, 1-4 replicas, with the shipped SmolLM2
        # profile; actuator ray (KubeRay's in-tree autoscaler adds the pods): no RBAC for the head
        a = config.autoscaling
        assert (a.enabled, a.actuator) == (True, "ray") and one(by_kind, "RayCluster")["spec"]["enableInTreeAutoscaling"]
        assert [(p.pool, p.min_replicas, p.max_replicas, p.slo_ttft_ms, p.slo_tpot_ms) for p in a.pools] == [
            ("default", 1, 4, 1000.0, 100.0)]
        assert (groups["default"]["minReplicas"], groups["default"]["maxReplicas"]) == (1, 4)
        profile = config.to_autoscaler_config().pool("default")
        assert profile.capacity.requests_per_s > 0 and profile.capacity.output_tokens_per_s > 0
        assert not {"ServiceAccount", "Role", "RoleBinding"} & set(by_kind)
    elif name == "colocated-values":
        assert config.pools[0].replicas == 4 and config.pools[0].engine.kv_cache_memory_bytes == 2 << 30
        assert config.router.policy == "least_loaded" and config.model.max_model_len == 4096
        assert config.model.quantization == "q4"
        spec = config.pools[0].speculative
        assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) == ("ngram", 6, 1, 3)
        assert dict(spec.drafter_resources) == {}  # prompt lookup runs in the worker: no drafter actor
        assert (groups["serve"]["minReplicas"], groups["serve"]["maxReplicas"]) == (2, 8)
        # TLS + tokens reach the router as DUET_* env (not the shared ConfigMap); the loader takes them
        router = one(by_kind, "Deployment")["spec"]["template"]["spec"]
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
        monitor = one(by_kind, "ServiceMonitor")
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert len(by_kind["PodDisruptionBudget"]) == 2  # routers + head
    elif name == "disaggregated-values":
        assert [(p.name, p.role) for p in config.pools] == [("prefill", "prefill"), ("decode", "decode")]
        assert set(groups) == {"prefill", "decode", "drafters"}
        assert pools["prefill"].speculative.method == "none"
        spec = pools["decode"].speculative
        assert (spec.method, spec.draft_model, spec.draft_quantization) == (
            "draft_model", "/models/Qwen2.5-Coder-0.5B-Instruct", "none")
        assert (spec.num_speculative_tokens, spec.drafter_cpus) == (5, 4)
        # The chart's default: drafter actors ask for the drafter pods' resource, one unit per CPU.
        assert dict(spec.drafter_resources) == {"drafter": 4}
        for gpu_group in ("prefill", "decode"):
            assert pod[gpu_group]["nvidia.com/gpu"] == "1"
            assert groups[gpu_group]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
        drafters = groups["drafters"]
        assert "nvidia.com/gpu" not in pod["drafters"] and "num-gpus" not in drafters["rayStartParams"]
        assert drafters["rayStartParams"]["resources"] == '"{\\"drafter\\": 16}"'  # KubeRay's documented form
        assert drafters["template"]["metadata"]["labels"]["duet.ai/role"] == "drafter"
        assert drafters["template"]["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "c7i.4xlarge"}
        assert dict(config.router.policy_options) == {"balance_rel": 1.5}
        engine = config.to_engine_config(pools["decode"])  # the engine's own validation accepts it
        assert engine.speculative.drafter_resources == (("drafter", 4.0),)
    elif name == "drafter-pool-values":
        assert [(p.name, p.role) for p in config.pools] == [
            ("prefill", "prefill"), ("decode", "decode"), ("cpu_drafters", "drafter")]
        assert set(groups) == {"prefill", "decode", "cpu-drafters"}  # a pool like any other: its own group
        spec = pools["decode"].speculative
        assert (spec.method, spec.drafter_pool, spec.draft_model) == ("draft_model", "cpu_drafters", None)
        drafters = pools["cpu_drafters"]
        engine = config.to_drafter_engine_config(drafters)
        assert (engine.model, engine.quantization, engine.dtype, engine.device) == (
            "/models/Qwen2.5-Coder-0.5B-Instruct", "int8", "float32", "cpu")
        assert (drafters.cpus_per_replica, drafters.gpus_per_rank, drafters.replicas) == (16, 0, 2)
        assert "nvidia.com/gpu" not in pod["cpu-drafters"] and pod["decode"]["nvidia.com/gpu"] == "1"
        group = groups["cpu-drafters"]
        assert group["template"]["metadata"]["labels"]["duet.ai/role"] == "drafter"
        assert group["template"]["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "c7i.4xlarge"}
        assert "lifecycle" not in group["template"]["spec"]["containers"][0]  # no drain: its state is a cache
        assert group["maxReplicas"] == 4
    elif name == "moe-values":
        cluster = one(by_kind, "RayCluster")
        assert cluster["spec"]["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster["spec"]
        moe = pools["moe"]
        assert (moe.ep_size, moe.tp_size, moe.sp_size, moe.gang_size, moe.cpus_per_replica) == (4, 1, 1, 4, 2)
        assert moe.placement_strategy == "PACK"
        assert config.model.name == "/models/mixtral-upcycled"
        assert groups["moe"]["rayStartParams"] == {"num-cpus": "8", "num-gpus": "4", "resources": '"{\\"duet_pool_moe\\": 4}"'}
        assert (moe.gpus_per_rank, dict(moe.resources_per_rank)) == (1, {"duet_pool_moe": 1})
        assert pod["moe"] == {"memory": "64Gi", "nvidia.com/gpu": "4"}
        volumes = {v["name"]: v for v in groups["moe"]["template"]["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "moe-weights"
        assert "NetworkPolicy" not in by_kind and "PodDisruptionBudget" not in by_kind
    elif name == "tp-values":
        assert [(p.name, p.tp_size, p.sp_size, p.ep_size) for p in config.pools] == [
            ("chat", 4, 1, 1), ("long_context", 2, 2, 1)]
        assert pools["long_context"].engine.max_num_batched_tokens == 2048
        for group, pool in (("chat", "chat"), ("long-context", "long_context")):
            assert groups[group]["rayStartParams"] == {
                "num-cpus": "8", "num-gpus": "4", "resources": f'"{{\\"duet_pool_{pool}\\": 4}}"'}
            assert pod[group] == {"memory": "48Gi", "nvidia.com/gpu": "4"}
        assert (groups["chat"]["replicas"], groups["chat"]["maxReplicas"]) == (2, 4)
    elif name == "slo-values":
        _check_slo_variant(config, by_kind, groups)
    elif name == "multi-model-values":  # two base models, adapters (tests/deploy/test_chart_models.py)
        assert [m.served for m in config.served_models] == ["SmolLM2-135M-Instruct", "coder"]
        assert [(p.name, p.model) for p in config.pools] == [("smol", "SmolLM2-135M-Instruct"), ("coder", "coder")]
        assert set(groups) == {"smol", "coder"} and groups["smol"]["replicas"] == 2
        assert pod["coder"]["memory"] == "6Gi" and config.pools[1].cpus_per_replica == 4
    else:
        raise AssertionError(f"new variant {name}: add its checks here")
    if name not in ("slo-values", "default"):  # own pools without slo + profile: Duet's autoscaler off, no RBAC
        assert not {"ServiceAccount", "Role", "RoleBinding"} & set(by_kind) and not config.autoscaling.enabled


def _check_slo_variant(config, by_kind, groups) -> None:
    """Duet's SLO autoscaler with the Kubernetes actuator: the config names the RayCluster and the
    router's metrics; the head runs as a ServiceAccount allowed exactly the actuator's calls."""
    a = config.autoscaling
    assert (a.enabled, a.actuator, a.kubernetes.raycluster, a.kubernetes.namespace) == (
        True, "kubernetes", FULLNAME, NAMESPACE)
    assert a.metrics_urls == (f"dns+http://{FULLNAME}-router-pods:9090/metrics",)  # every router, not one
    assert one(by_kind, "Deployment", f"{FULLNAME}-router")["spec"]["replicas"] == 3
    assert one(by_kind, "Service", f"{FULLNAME}-router")["spec"]["ports"][1] == {
        "name": "metrics", "port": 9090, "targetPort": "metrics"}
    pods = one(by_kind, "Service", f"{FULLNAME}-router-pods")["spec"]
    assert pods["clusterIP"] == "None" and pods["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics"}]
    assert pods["selector"] == one(by_kind, "Service", f"{FULLNAME}-router")["spec"]["selector"]
    assert (a.interval_s, a.drain_grace_s, a.down_cooldown_s) == (10.0, 120.0, 300.0)
    scaled = {p.pool: (p.min_replicas, p.max_replicas, p.slo_ttft_ms, p.slo_tpot_ms) for p in a.pools}
    assert scaled == {"prefill": (1, 3, 1000.0, None), "decode": (1, 6, None, 100.0)}
    auto = config.to_autoscaler_config()  # the profiles in the ConfigMap load
    assert auto.pool("decode").capacity.output_tokens_per_s == 100.0
    cluster = one(by_kind, "RayCluster")["spec"]
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    assert {g: (groups[g]["minReplicas"], groups[g]["maxReplicas"]) for g in groups} == {"prefill": (1, 3), "decode": (1, 6)}
    name = f"{FULLNAME}-autoscaler"
    assert cluster["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == name
    assert one(by_kind, "ServiceAccount", name)
    assert one(by_kind, "Role", name)["rules"] == [
        {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "resourceNames": [FULLNAME], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    binding = one(by_kind, "RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    policy = one(by_kind, "NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"][1]
    assert {"podSelector": {"matchLabels": {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}}} in policy["from"]


def test_not_yet_used_values_are_reported_in_notes(helm):
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 "-f", str(VARIANTS["disaggregated-values"]))
    assert r.returncode == 0, r.stderr
    notes = r.stdout[r.stdout.index("NOTES:"):]
    assert "NOT YET USED" in notes
    for line in ("pools[prefill].slo", 'decode (decode, 2 x 1-rank replica: 2 CPU + 1 GPU per pod; speculative draft_model)',
                 'drafters (2 x 16 CPU, Ray resource "drafter")'):
        assert line in notes, line
    # GPUs and per-pool placement are wired (gpus_per_rank, resources_per_rank): no warning about them
    assert "gpusPerRank" not in notes and "another group" not in notes and "reserve only CPUs" not in notes
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 "-f", str(VARIANTS["moe-values"]))
    assert "moe (colocated, 2 x 4-rank replica [ep 4 x sp 1 x tp 1]: 8 CPU + 4 GPU per pod)" in r.stdout
    assert "another group's pods" not in r.stdout  # one pool, no drafters: nothing to mix up
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert r.returncode == 0 and "NOT YET USED" not in r.stdout and "duet generate --target" in r.stdout
    assert "request GPUs but image.variant" not in r.stdout
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "poolDefaults.gpusPerRank=1")
    assert r.returncode == 0 and 'pools default request GPUs but image.variant is "cpu"' in r.stdout
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "drafters.enabled=true")
    assert r.returncode == 0 and "no pool has speculative.method draft_model" in r.stdout
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "poolDefaults.speculative.method=draft_model",
                 "--set", "poolDefaults.speculative.draftModel=/m/d")  # no drafters group: drafters ask for CPUs only
    assert r.returncode == 0 and "pools[default].speculative.drafterResources is {}: its drafter actors ask for CPUs only" in r.stdout
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "poolDefaults.speculative.method=draft_model",
                 "--set", "poolDefaults.speculative.draftModel=/m/d", "--set", "drafters.enabled=true")
    assert r.returncode == 0 and "drafterResources is {}" not in r.stdout
