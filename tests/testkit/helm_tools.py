"""Helpers of the deployment tests: where the chart and helm are, and rendering it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "duet"
RELEASE = "demo"
NAMESPACE = "serving"


def helm_path() -> Path:
    """helm from `make helm` (.tools/helm), or $DUET_HELM."""
    return Path(os.environ.get("DUET_HELM") or ROOT / ".tools" / "helm")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def render(helm: Path, values_file: Path | None = None, *sets: str) -> list[dict]:
    """`helm template` -> the rendered objects (NOTES excluded)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values_file is not None:
        args += ["-f", str(values_file)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode == 0, r.stderr
    return [doc for doc in yaml.safe_load_all(r.stdout) if doc]


VARIANTS: dict[str, Path | None] = {"default": None, **{p.stem: p for p in sorted((CHART / "ci").glob("*-values.yaml"))}}
"""The default values and every worked example in ci/ (name -> values file)."""


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


def one(kinds: dict[str, list[dict]], kind: str, name: str | None = None) -> dict:
    objs = [o for o in kinds.get(kind, []) if name is None or o["metadata"]["name"] == name]
    assert len(objs) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in objs]}"
    return objs[0]


def loaded_config(kinds: dict[str, list[dict]], tmp_path: Path, env: dict[str, str] | None = None):
    """The rendered ConfigMap's duet.yaml, loaded by Duet's own loader (cluster.config.duet.load_config).
    Every key of the ConfigMap becomes a file in tmp_path, as the pods mount it at /etc/duet (the
    config's /etc/duet/ paths, e.g. autoscaling profiles, are pointed there)."""
    from cluster.config.duet import load_config

    for key, text in one(kinds, "ConfigMap")["data"].items():
        (tmp_path / key).write_text(text.replace("/etc/duet/", f"{tmp_path}/") if key == "duet.yaml" else text)
    path = tmp_path / "duet.yaml"
    return load_config(path, env=env or {})


def ray_node_types(kinds: dict[str, list[dict]]) -> dict[str, dict]:
    """What Ray's own KubeRay autoscaler (the ray package pinned in pyproject.toml, the version in the
    image) reads from the rendered RayCluster: group name -> {resources, min_workers, max_workers}.
    It parses rayStartParams (num-cpus, num-gpus, the custom `resources` string) and the pod limits
    exactly as the autoscaler sidecar does, and validates the result."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cluster = dict(one(kinds, "RayCluster"))
    cluster["metadata"] = {**cluster["metadata"], "namespace": NAMESPACE}
    return _derive_autoscaling_config_from_ray_cr(cluster)["available_node_types"]
