"""Decode steps through the fused C++ decoder stack vs the module path, on the real SmolLM2.

For fp32, int8 and q4 weights (fp32 activations) and a bf16 model the engine runs the same prompts (a batch of mixed lengths, so
steps mix prefill and decode-only, and decode-only steps carry 1..4 sequences) twice, with
the fused stack on and off (EngineConfig.fused_decode, the model's ``fused_decode``): every step's
logits must be bit-identical, and with them the greedy tokens. Models the stack does not cover (MoE
layers) keep the module path, and fused_decode=False reaches the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.mixtral_tiny import save_tiny_mixtral

from kernels.quant_linear import quant_tiles_used
from workers.layers.quant_linear import QuantLinear
from workers.llm import LLM
from workers.models.decode_stack import fused_stack
from workers.models.llama import FUSED_STACK_TYPES
from workers.sampling_params import SamplingParams

PROMPTS = [list(range(100, 120)), list(range(300, 303)), list(range(1000, 1041)), [1, 504, 3575, 282, 4649, 314]]


def _run(llm: LLM, monkeypatch: pytest.MonkeyPatch, fused: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    model = llm.engine.runner.model
    model.fused_decode = fused
    model._stack = None  # decided again under the new setting
    logits: list[torch.Tensor] = []
    plain_logits = type(model).compute_logits

    def record(self, hidden: torch.Tensor) -> torch.Tensor:
        out = plain_logits(self, hidden)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(type(model), "compute_logits", record)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    finally:
        monkeypatch.setattr(type(model), "compute_logits", plain_logits)
    assert bool(model._stack) == fused  # the path under test really ran
    return [o.token_ids for o in outs], logits


@pytest.mark.parametrize("quantization,dtype,kv", [("none", "float32", "auto"), ("int8", "float32", "auto"),
                                                   ("q4", "float32", "auto"), ("q4", "float32", "float32"),
                                                   ("none", "float32", "bfloat16"), ("none", "bfloat16", "auto")])
def test_fused_decode_is_bit_identical(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str,
                                       dtype: str, kv: str) -> None:
    """Every activation dtype, quantization and KV cache dtype the stack takes (int8 / q4 with 'auto':
    a bf16 cache on CPU; an fp32 model with an explicit bf16 cache)."""
    llm = LLM(str(smollm2_path), quantization=quantization, dtype=dtype, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=48, kv_cache_dtype=kv)
    expected_kv = {"auto": torch.bfloat16 if quantization != "none" else getattr(torch, dtype),
                   "float32": torch.float32, "bfloat16": torch.bfloat16}[kv]
    assert llm.engine.runner.kv_cache.dtype == expected_kv
    tokens_fused, logits_fused = _run(llm, monkeypatch, fused=True)
    tokens_plain, logits_plain = _run(llm, monkeypatch, fused=False)
    assert tokens_fused == tokens_plain
    assert len(logits_fused) == len(logits_plain) > 20
    assert all(torch.equal(a, b) for a, b in zip(logits_fused, logits_plain))


def test_moe_models_keep_the_module_path(tmp_path: Path, smollm2_path: Path) -> None:
    path = save_tiny_mixtral(tmp_path / "mixtral", smollm2_path)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=8)
    assert fused_stack(llm.engine.runner.model, FUSED_STACK_TYPES) is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_engine_config_reaches_the_model(smollm2_path: Path) -> None:
    llm = LLM(str(smollm2_path), fused_decode=False, kv_cache_memory_bytes=16 << 20)
    model = llm.engine.runner.model
    assert model.fused_decode is False
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert model._stack is False  # decode steps ran, and not through the stack


@pytest.mark.parametrize("quantization,fused", [("q4", True), ("q4", False), ("int8", True)])
def test_tiles_change_no_logit(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str,
                               fused: bool) -> None:
    """A quantized model on a VNNI CPU keeps its weights in the kernel's tile order too (loader.py,
    QuantLinear.make_tiles; the int8 LM head of a q4 model included): every logit is the same with
    them and without them, through the fused stack and the module path."""
    llm = LLM(str(smollm2_path), quantization=quantization, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=48)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert {m.method for m in layers} == {quantization, "int8"}  # the LM head is int8 either way
    assert all((m.tiles is not None) == quant_tiles_used() for m in layers)
    tokens_tiled, logits_tiled = _run(llm, monkeypatch, fused=fused)
    for m in layers:
        m.tiles = None  # _run builds the stack again, now without them
    tokens_plain, logits_plain = _run(llm, monkeypatch, fused=fused)
    assert tokens_tiled == tokens_plain
    assert len(logits_tiled) == len(logits_plain) > 20
    assert all(torch.equal(a, b) for a, b in zip(logits_tiled, logits_plain))
