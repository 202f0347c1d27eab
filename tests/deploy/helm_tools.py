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
