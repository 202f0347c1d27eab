"""How the suite uses the CPUs under pytest-xdist (tests/conftest.py): each worker's torch gets its
share of the CPUs as OpenMP threads (at least one), and outside xdist nothing is set."""

from __future__ import annotations

import os

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

