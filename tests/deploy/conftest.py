"""Fixtures of the deployment tests: the helm binary (``make helm`` puts it in .tools/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit.helm_tools import helm_path


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm v4.1.4 from `make helm` (or $DUET_HELM). Missing, the chart tests fail -- CI must run them
    -- unless DUET_SKIP_HELM_TESTS=1 says explicitly that this machine has no helm."""
    path = helm_path()
    if not path.is_file():
        if os.environ.get("DUET_SKIP_HELM_TESTS") == "1":
            pytest.skip(f"no helm at {path} and DUET_SKIP_HELM_TESTS=1")
        pytest.fail(f"no helm at {path}: run `make helm` (or set DUET_HELM; DUET_SKIP_HELM_TESTS=1 to skip)")
    return path
