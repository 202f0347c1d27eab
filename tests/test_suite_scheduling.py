"""How the suite is scheduled: under pytest-xdist (tests/conftest.py) each worker's torch gets its
share of the CPUs as OpenMP threads (at least one), and outside xdist nothing is set; `make test`
runs the serial phase after the rest even when the rest failed, and fails when either phase did."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _xdist_worker_threads


@pytest.mark.parametrize(("workers", "cpus", "want"), [(None, 2, None), ("2", 2, 1), ("2", 8, 4), ("4", 2, 1)])
def test_worker_threads_share_the_cpus(monkeypatch, workers, cpus, want):
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert _xdist_worker_threads() == want



# ---- `make test`: both phases run, and either failing fails the target ------------------------------

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTEST = """\
import os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
serial = sys.argv[sys.argv.index("-m") + 1] == "serial"
sys.exit(int(os.environ["FAKE_SERIAL_RC" if serial else "FAKE_FIRST_RC"]))
"""


@pytest.mark.parametrize(("first", "serial", "ok"), [(0, 0, True), (1, 0, False), (0, 1, False), (5, 0, False),
                                                     (0, 5, False), (2, 5, False)])
def test_make_test_runs_both_phases_and_fails_if_either_did(tmp_path, first, serial, ok):
    """The Makefile's `test` recipe, with a fake pytest that logs its arguments and exits as told (5 is
    pytest's "no tests collected"): the serial phase runs after a failed first phase, and the exit
    code is non-zero when either phase's was. `-o setup` skips building the venv."""
    fake = tmp_path / "fake_pytest.py"
    fake.write_text(FAKE_PYTEST)
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    env.update(FAKE_LOG=str(log), FAKE_FIRST_RC=str(first), FAKE_SERIAL_RC=str(serial))
    r = subprocess.run(["make", "-s", "-o", "setup", "test", f"PYTEST={sys.executable} {fake}", "PYTEST_WORKERS=2",
                        "ARGS="], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert log.read_text().splitlines() == ["-n 2 --dist loadfile -m not serial", "-m serial"], r.stdout + r.stderr
    assert (r.returncode == 0) is ok, r.stdout + r.stderr
    assert f"not-serial phase exited {first}, serial phase exited {serial}" in r.stdout
