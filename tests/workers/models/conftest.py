"""The ``tiny_checkpoint`` fixture: tests/testkit/tiny_families.py's random checkpoints in tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.testkit.tiny_families import TINY, hf_generate, save_tiny  # noqa: F401 (re-exported)


@pytest.fixture
def tiny_checkpoint(tmp_path: Path, smollm2_path: Path) -> Callable[..., Path]:
    def make(arch: str, **overrides) -> Path:
        return save_tiny(tmp_path / arch, smollm2_path, arch, **overrides)

    return make
