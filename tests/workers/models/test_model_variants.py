"""Architecture variants on tiny random checkpoints, against HF transformers: Qwen2 (q/k/v biases,
untied LM head), Llama with llama3 rope scaling and with linear rope scaling. Real model code and
real loading paths; only the weights are random (no such checkpoints exist offline)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from workers.llm import LLM
from workers.sampling_params import SamplingParams
from testkit.tiny_families import hf_generate

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152)


def _save_tiny(tmp: Path, smollm2_path: Path, arch: str, **extra) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **TINY, **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random biases too (HF initialises them to zero)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    out = tmp / arch
    model.save_pretrained(out)
    for f in smollm2_path.iterdir():  # a real tokenizer; the engine loads one with the model
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("qwen2", {"tie_word_embeddings": False}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   "tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": False}),
    ],
    ids=["qwen2-bias-untied", "llama3-rope", "linear-rope-untied"],
)
def test_variant_matches_hf(tmp_path, smollm2_path, arch, extra):
    path = _save_tiny(tmp_path, smollm2_path, arch, **extra)
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(100, 190))]  # 90 tokens: positions past 64
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    spec = llm.engine.spec
    assert spec.model_type == arch and spec.tie_word_embeddings == extra["tie_word_embeddings"]
    assert (spec.rope_scaling is not None) == ("rope_scaling" in extra)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_generate(path, prompt, 12)
