"""Fixtures for the LoRA tests: a tiny random Llama and adapters on it made with PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.lora_cases import save_adapter
from testkit.tiny_families import save_tiny


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_path: Path) -> Path:
    """A random Llama (2 layers, hidden 64, GQA 4/2) with SmolLM2's tokenizer."""
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), smollm2_path, "llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory, tiny_llama: Path) -> dict[str, Path]:
    """Three adapters of the tiny Llama: every module at rank 8, q/v only at rank 4 with rslora,
    and the MLP only at rank 16 (the slots' max rank in the tests)."""
    root = tmp_path_factory.mktemp("tiny_adapters")
    return {
        "all8": save_adapter(tiny_llama, root / "all8", seed=1, r=8, alpha=16, b_std=0.3),
        "qv4": save_adapter(tiny_llama, root / "qv4", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj"],
                            rslora=True, b_std=0.3),
        "mlp16": save_adapter(tiny_llama, root / "mlp16", seed=3, r=16, alpha=32,
                              targets=["gate_proj", "up_proj", "down_proj"], b_std=0.3),
    }
