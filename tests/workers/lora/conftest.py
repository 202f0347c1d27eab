"""Fixtures of the LoRA tests: adapters of the real SmolLM2 (PEFT, random, small enough that the
model stays fluent, large enough that greedy output changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.lora_cases import save_adapter


@pytest.fixture(scope="session")
def smol_adapters(tmp_path_factory, smollm2_path: Path) -> dict[str, Path]:
    """q/k/v/o at rank 8 and the MLP at rank 16."""
    root = tmp_path_factory.mktemp("smol_adapters")
    return {"qkvo": save_adapter(smollm2_path, root / "qkvo", seed=5, r=8, alpha=16,
                                 targets=["q_proj", "k_proj", "v_proj", "o_proj"], b_std=0.02),
            "mlp": save_adapter(smollm2_path, root / "mlp", seed=6, r=16, alpha=16,
                                targets=["gate_proj", "up_proj", "down_proj"], b_std=0.02)}
