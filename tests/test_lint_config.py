"""The static checks keep checking: `make lint` runs them, .ci/run runs `make lint`, and the
configuration in pyproject.toml still reaches every package (an exclude that swallowed a folder,
or a rule set that lost its rules, would pass silently otherwise).

Each probe hands the linter a small bad file under a path inside a package, with the project's
own configuration, and expects the finding; nothing is written into the tree.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
MYPY = Path(sys.executable).with_name("mypy")
# Every folder of the distribution (pyproject's packages.find) and the tests.
PACKAGES = ("cluster", "workers", "router", "kernels", "protos", "benchmarks", "tests")


def _ruff(path: str, source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RUFF), "check", "--force-exclude", "--no-cache", "--output-format", "concise",
                           "--stdin-filename", path, "-"],
                          input=source, capture_output=True, text=True, cwd=ROOT, timeout=60)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_packages_match_the_distribution() -> None:
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} | {"tests"} == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_ruff_checks_every_package(package: str) -> None:
    bad = "import os\n\n\ndef f(x):\n    try:\n        return x\n    except Exception:\n        return None\n"
    out = _ruff(f"{package}/lint_probe.py", bad)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "F401" in out.stdout and "BLE001" in out.stdout, out.stdout


def test_ruff_reports_a_noqa_that_guards_nothing() -> None:
    out = _ruff("workers/lint_probe.py", "X = 1  # noqa: F401\n")
    assert out.returncode == 1 and "RUF100" in out.stdout, out.stdout + out.stderr


def test_ruff_leaves_out_only_the_generated_stubs() -> None:
    assert _ruff("protos/duet/v1/lint_probe_pb2.py", "import os\n").returncode == 0
    assert _ruff("protos/duet/v1/lint_probe_pb2_grpc.py", "import os\n").returncode == 0
    assert _ruff("protos/lint_probe.py", "import os\n").returncode == 1


def test_ci_runs_make_lint_and_make_lint_runs_the_checkers() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make lint" in ci and "make test" in ci
    # -o: treat the venv as built, so this prints the recipe without setting anything up.
    dry = subprocess.run(["make", "-n", "-o", ".venv/.duet-setup.stamp", "lint"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "ruff check ." in dry.stdout and "mypy" in dry.stdout, dry.stdout


def test_mypy_checks_the_library_and_ignores_nothing_wholesale() -> None:
    mypy = _pyproject()["tool"]["mypy"]
    # Every package of the distribution (tests/: ruff only).
    assert set(mypy["files"]) == set(PACKAGES) - {"tests"}
    for override in mypy.get("overrides", []):  # a module's errors are fixed, not switched off
        assert not override.get("ignore_errors"), override
        assert not override.get("follow_imports") == "skip", override
    assert mypy.get("warn_unused_ignores") is True  # a stale `type: ignore` fails like a stale noqa


def test_mypy_reports_a_type_error_with_the_project_config(tmp_path: Path) -> None:
    probe = tmp_path / "lint_probe.py"
    probe.write_text("def f(x: int) -> str:\n    return x\n")
    out = subprocess.run([str(MYPY), "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
                          "--cache-dir", str(tmp_path / "cache"), str(probe)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1 and "[return-value]" in out.stdout, out.stdout + out.stderr
