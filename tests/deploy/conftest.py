"""Fixtures of the deployment tests: the helm binary (``make helm`` puts it in .tools/) and renders."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "duet"
RELEASE = "demo"
NAMESPACE = "serving"


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm v4.1.4 from `make helm` (or $DUET_HELM). Missing, the chart tests fail -- CI must run them
    -- unless DUET_SKIP_HELM_TESTS=1 says explicitly that this machine has no helm."""
    path = Path(os.environ.get("DUET_HELM") or ROOT / ".tools" / "helm")
    if not path.is_file():
        if os.environ.get("DUET_SKIP_HELM_TESTS") == "1":
            pytest.skip(f"no helm at {path} and DUET_SKIP_HELM_TESTS=1")
        pytest.fail(f"no helm at {path}: run `make helm` (or set DUET_HELM; DUET_SKIP_HELM_TESTS=1 to skip)")
    return path


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
