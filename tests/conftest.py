"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.models.assets import prepare_smollm2


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model as a safetensors checkpoint (converted once per machine, then cached)."""
    return prepare_smollm2()
