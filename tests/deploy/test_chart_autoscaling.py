"""Duet's SLO autoscaler in the chart (``autoscaling.duet``): values the schema or the chart's
checks refuse, each with a message naming the value and the fix, and who owns which pods. The
rendering that works (ConfigMap loaded by Duet's loader, RBAC objects validated by
kubernetes-validate --strict) is the ``slo-values`` variant of test_helm_chart.py."""

from __future__ import annotations

import json

import pytest
import yaml
from testkit.helm_tools import CHART, NAMESPACE, RELEASE, by_kind, loaded_config, render, run_helm

SLO_VALUES = CHART / "ci" / "slo-values.yaml"


@pytest.mark.parametrize("sets, message", [
    # the schema
    (["autoscaling.duet.actuator=kubectl"], "at '/autoscaling/duet/actuator': value must be one of 'ray', 'kubernetes'"),
    (["autoscaling.duet.intervalSeconds=0"], "at '/autoscaling/duet/intervalSeconds'"),
    (["autoscaling.duet.drainGraceSeconds=-1"], "at '/autoscaling/duet/drainGraceSeconds'"),
    (["autoscaling.duet.speed=fast"], "additional properties 'speed' not allowed"),
    (["poolDefaults.profile.format=duet-profile/1"], "at '/poolDefaults/profile': missing property 'capacity'"),
    # the chart's checks: KubeRay's in-tree autoscaler and Duet's actuator never drive the same groups
    (["autoscaling.enableInTreeAutoscaling=true"],
     "autoscaling.duet.actuator=kubernetes with autoscaling.enableInTreeAutoscaling=true: both would resize the same worker groups"),
    (["autoscaling.duet.actuator=ray"],
     "autoscaling.duet.actuator=ray needs autoscaling.enableInTreeAutoscaling=true"),
    (["router.metrics.enabled=false"], "autoscaling.duet.enabled=true needs router.metrics.enabled=true"),
])
def test_bad_autoscaling_values_are_rejected_with_a_clear_message(helm, sets, message):
    args = ["template", RELEASE, str(CHART), "-f", str(SLO_VALUES)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode != 0, f"rendered: {sets}"
    assert message in r.stderr, r.stderr


def test_ray_actuator_leaves_the_pods_to_kuberay_and_creates_no_rbac(helm, tmp_path):
    kinds = by_kind(render(helm, SLO_VALUES, "autoscaling.duet.actuator=ray", "autoscaling.enableInTreeAutoscaling=true"))
    config = loaded_config(kinds, tmp_path)
    assert config.autoscaling.actuator == "ray" and config.autoscaling.kubernetes.raycluster == ""
    assert not {"ServiceAccount", "Role", "RoleBinding"} & set(kinds)
    head = kinds["RayCluster"][0]["spec"]["headGroupSpec"]["template"]["spec"]
    assert "serviceAccountName" not in head
    assert kinds["RayCluster"][0]["spec"]["enableInTreeAutoscaling"] is True


def test_no_pool_with_slo_and_profile_keeps_every_size_and_notes_say_so(helm, tmp_path):
    """autoscaling.duet.enabled is the default: a deployment whose own pools have no slo + profile
    renders, without an autoscaling section (the loader would refuse one listing no pool), and NOTES
    says nothing is scaled; the actuator's requirements do not apply then."""
    sets = ("pools[0].profile=null", "pools[1].profile=null", "autoscaling.duet.actuator=ray")
    kinds = by_kind(render(helm, SLO_VALUES, *sets))
    config = loaded_config(kinds, tmp_path)
    assert not config.autoscaling.enabled and not config.autoscaling.pools
    assert not {"ServiceAccount", "Role", "RoleBinding"} & set(kinds)
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 "-f", str(SLO_VALUES), *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr
    assert "autoscaling.duet.enabled: no pool has both slo and a profile of its model, so Duet's SLO autoscaler scales nothing" in r.stdout


def test_notes_say_what_the_autoscaler_scales_by_default(helm):
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert r.returncode == 0, r.stderr
    assert ("Duet's SLO autoscaler (actuator ray) scales: default (1-4 replicas; p90 TTFT 1000 ms TPOT 100 ms; "
            "capacity ") in r.stdout and "measured for SmolLM2-135M-Instruct)" in r.stdout
    assert "WARNING" not in r.stdout  # the defaults render without a note


def test_a_profile_of_another_model_does_not_scale_the_pool_and_notes_say_so(helm, tmp_path):
    """The default pool's shipped profile is SmolLM2's: a deployment serving another model renders,
    that pool keeps its size (no autoscaling section), and NOTES names both models."""
    sets = ("model.name=/models/Qwen2.5-Coder-1.5B-Instruct",)
    kinds = by_kind(render(helm, None, *sets))
    assert not loaded_config(kinds, tmp_path).autoscaling.enabled
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, "--set", sets[0])
    assert r.returncode == 0, r.stderr
    assert ("pools[default].profile was measured for model SmolLM2-135M-Instruct, not the model this pool serves "
            "(Qwen2.5-Coder-1.5B-Instruct)") in r.stdout
    # a profile of that model (by its path's last component, or by the served name) scales it again
    for model in ("/elsewhere/Qwen2.5-Coder-1.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"):
        pool = {"name": "default", "role": "colocated", "maxReplicas": 4, "slo": {"ttftMs": 1000, "tpotMs": 100},
                "profile": {"format": "duet-profile/1", "model": model, "pool_type": "colocated",
                            "slo": {"ttft_p90_s": 1.0, "tpot_p90_s": 0.1}, "capacity": {"requests_per_s": 2.0}}}
        r = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", sets[0],
                     "--set-json", f"pools={json.dumps([pool])}")
        assert r.returncode == 0, r.stderr
        kinds = by_kind([doc for doc in yaml.safe_load_all(r.stdout) if doc])
        assert [p.pool for p in loaded_config(kinds, tmp_path).autoscaling.pools] == ["default"]


def test_a_pool_without_slo_or_profile_keeps_its_size_and_notes_say_so(helm, tmp_path):
    kinds = by_kind(render(helm, SLO_VALUES, "pools[0].profile=null"))
    assert [p.pool for p in loaded_config(kinds, tmp_path).autoscaling.pools] == ["decode"]
    assert "profile-prefill.json" not in kinds["ConfigMap"][0]["data"]
    r = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 "-f", str(SLO_VALUES), "--set", "pools[0].profile=null")
    assert r.returncode == 0, r.stderr
    assert "pools[prefill].slo/profile: Duet's SLO autoscaler scales a pool only with slo, profile" in r.stdout


def test_runbook_profile_from_a_file_reaches_the_configmap(helm, tmp_path):
    """The README runbook's --set-json of a `duet profile` file into one pool of a values list."""
    profile = ('{"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "decode", "slo": {"tpot_p90_s": 0.1}, '
               '"capacity": {"requests_per_s": 3.0, "mean_output_tokens": 40.0}}')
    r = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(SLO_VALUES),
                 "--set-json", f"pools[1].profile={profile}")
    assert r.returncode == 0, r.stderr
    kinds = by_kind([doc for doc in yaml.safe_load_all(r.stdout) if doc])
    config = loaded_config(kinds, tmp_path)
    assert config.to_autoscaler_config().pool("decode").capacity.output_tokens_per_s == 120.0
    assert [p.pool for p in config.autoscaling.pools] == ["prefill", "decode"]  # the other pool untouched


def test_three_routers_with_slo_autoscaling_and_gcs_fault_tolerance(helm, tmp_path):
    """router.replicas: 3 with Duet's autoscaler (it reads every router through the headless Service)
    and GCS fault tolerance on an external Redis: renders, and the objects hold what the values say."""
    from testkit.helm_tools import one

    kinds = by_kind(render(helm, SLO_VALUES, "router.replicas=3", "head.gcsFaultTolerance.redisAddress=redis:6379",
                           "head.gcsFaultTolerance.redisPasswordSecret=redis-auth",
                           "head.gcsFaultTolerance.externalStorageNamespace=duet-prod"))
    config = loaded_config(kinds, tmp_path)
    assert config.autoscaling.enabled and config.autoscaling.metrics_urls[0].startswith("dns+http://")
    assert one(kinds, "Deployment")["spec"]["replicas"] == 3
    ft = kinds["RayCluster"][0]["spec"]["gcsFaultToleranceOptions"]
    assert ft == {"redisAddress": "redis:6379", "externalStorageNamespace": "duet-prod",
                  "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}}}
    off = by_kind(render(helm, SLO_VALUES))
    assert "gcsFaultToleranceOptions" not in off["RayCluster"][0]["spec"]
