"""Tiny random-weight checkpoints written with transformers' own config and model classes, and
transformers' greedy reference for them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152)


def save_tiny(out: Path, smollm2_path: Path, arch: str, **overrides) -> Path:
    """Write a random ``arch`` checkpoint (TINY sizes, ``overrides`` on top) plus SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random norms, biases and router biases too (HF initialises them to constants)
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name or "e_score_correction_bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.add_(torch.randn_like(b) * 0.3)
    model.save_pretrained(out)
    for f in smollm2_path.iterdir():  # a real tokenizer; the engine loads one with the model
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def hf_generate(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def tiny_checkpoint(tmp_path: Path, smollm2_path: Path) -> Callable[..., Path]:
    def make(arch: str, **overrides) -> Path:
        return save_tiny(tmp_path / arch, smollm2_path, arch, **overrides)

    return make
