"""The chart's parts of fast replica starts (deploy/helm/duet, issue 32): the node-local model cache
(a hostPath volume every Duet pod mounts as its DUET_CACHE_DIR, pre-pulled by an init container
before Ray or the router start, and the workers' shared weights directory in it), standby replicas
(each one more pod of its pool's worker group), and the scale-to-zero values (the router's wake
timeout, the autoscaler's idle time and standby bound) reaching the config Duet loads."""

from __future__ import annotations

from testkit.helm_tools import CHART, by_kind, loaded_config, one, render

SLO_VALUES = CHART / "ci" / "slo-values.yaml"
CACHE = ["modelCache.enabled=true", "modelCache.hostPath=/mnt/duet-cache", "modelCache.mountPath=/cache"]


def _pod_specs(kinds) -> dict[str, dict]:
    ray = one(kinds, "RayCluster")["spec"]
    out = {"head": ray["headGroupSpec"]["template"]["spec"]}
    out.update({g["groupName"]: g["template"]["spec"] for g in ray["workerGroupSpecs"]})
    out.update({f"deployment/{d['metadata']['name']}": d["spec"]["template"]["spec"] for d in kinds["Deployment"]})
    return out


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_node_model_cache_is_mounted_pre_pulled_and_holds_the_shared_weights(helm, tmp_path):
    kinds = by_kind(render(helm, None, *CACHE, "model.name=Qwen/Qwen2.5-0.5B-Instruct"))
    specs = _pod_specs(kinds)
    assert len(specs) >= 3  # head, the default pool's group, the router Deployment
    for name, spec in specs.items():
        volume = next(v for v in spec["volumes"] if v["name"] == "node-model-cache")
        assert volume["hostPath"] == {"path": "/mnt/duet-cache", "type": "DirectoryOrCreate"}, name
        (init,) = spec["initContainers"]
        assert init["name"] == "model-cache-pre-pull"
        assert _env(init)["DUET_PRE_PULL_MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"
        assert "python -m workers.models.assets --model" in init["command"][-1]
        for c in [init, *spec["containers"]]:
            assert _env(c)["DUET_CACHE_DIR"] == "/cache", (name, c["name"])
            assert {"name": "node-model-cache", "mountPath": "/cache"} in c["volumeMounts"], (name, c["name"])
    assert loaded_config(kinds, tmp_path).model.shared_weights_dir == "/cache/weights"
    no_sharing = by_kind(render(helm, None, *CACHE, "modelCache.sharedWeights=false", "modelCache.prePull=false"))
    assert loaded_config(no_sharing, tmp_path).model.shared_weights_dir is None
    assert all("initContainers" not in spec for spec in _pod_specs(no_sharing).values())


def test_without_the_cache_nothing_changes(helm, tmp_path):
    kinds = by_kind(render(helm, None))
    for name, spec in _pod_specs(kinds).items():
        assert "initContainers" not in spec and all(v["name"] != "node-model-cache" for v in spec["volumes"]), name
        assert all(_env(c)["DUET_CACHE_DIR"] == "/opt/duet/cache" for c in spec["containers"]), name
    assert loaded_config(kinds, tmp_path).model.shared_weights_dir is None


def test_standby_replicas_are_pods_of_their_group(helm, tmp_path):
    kinds = by_kind(render(helm, None, "pools[0].name=main", "pools[0].role=colocated", "pools[0].replicas=2",
                           "pools[0].maxReplicas=4",
                           "pools[0].standbyReplicas=1"))
    (group,) = one(kinds, "RayCluster")["spec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 5)
    config = loaded_config(kinds, tmp_path)
    assert (config.pool.standby_replicas, config.pool.standby_load) == (1, "model")
    warm = by_kind(render(helm, None, "pools[0].name=main", "pools[0].role=colocated", "pools[0].standbyReplicas=1",
                          "pools[0].standbyLoad=process"))
    assert loaded_config(warm, tmp_path).pool.standby_load == "process"  # warm worker processes only


def test_scale_to_zero_values_reach_the_config(helm, tmp_path):
    kinds = by_kind(render(helm, SLO_VALUES, "router.wakeTimeoutSeconds=45", "autoscaling.duet.scaleToZeroAfterSeconds=120",
                           "pools[1].minReplicas=0", "pools[1].maxStandby=3"))
    config = loaded_config(kinds, tmp_path)
    assert config.router.wake_timeout_s == 45.0 and config.autoscaling.scale_to_zero_after_s == 120.0
    decode = next(p for p in config.autoscaling.pools if p.pool == "decode")
    assert (decode.min_replicas, decode.max_standby) == (0, 3)
    group = next(g for g in one(kinds, "RayCluster")["spec"]["workerGroupSpecs"] if g["groupName"] == "decode")
    assert group["minReplicas"] == 0 and group["maxReplicas"] == decode.max_replicas + 3
