"""Mixtral (workers/models/mixtral.py + workers/layers/moe.py) against HF transformers'
MixtralForCausalLM on a tiny random checkpoint: per-position logits of a batched prefill within
fp32 tolerance, and greedy continuations token for token. Both checkpoint layouts load: the
per-expert one transformers 5.23 writes and the fused [E, 2I, H] one it uses in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from testkit.mixtral_tiny import prefill_logits, save_tiny_mixtral
from workers.errors import CheckpointError
from workers.llm import LLM
from workers.sampling_params import SamplingParams

from testkit.tolerance import EXACT, MODEL_FP32

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 160)), [7]]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_mixtral(tmp_path_factory.mktemp("mixtral") / "tiny", smollm2_path)


@pytest.fixture(scope="module")
def hf_model(tiny_mixtral):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()


def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]  # [len, V]


def test_prefill_logits_match_hf(tiny_mixtral, hf_model):
    llm = LLM(str(tiny_mixtral), kv_cache_memory_bytes=8 << 20, block_size=8)
    assert llm.engine.spec.model_type == "mixtral" and llm.engine.spec.num_experts == 8
    ours = prefill_logits(llm.engine, PROMPTS)
    ref = torch.cat([_hf_logits(hf_model, p) for p in PROMPTS])
    MODEL_FP32.assert_close(ours, ref)


def test_greedy_matches_hf(tiny_mixtral, hf_model):
    llm = LLM(str(tiny_mixtral), kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    # every token computed routes to top-2 experts in each of the 2 layers: per-expert stats add up
    computed = sum(len(p) + 10 - 1 for p in PROMPTS)
    stats = llm.engine.stats()
    assert len(stats.expert_tokens) == 8 and sum(stats.expert_tokens) == 2 * 2 * computed
    assert stats.ep_rank_tokens == (2 * 2 * computed,)


def test_fused_layout_loads_identically(tiny_mixtral, hf_model, tmp_path):
    """Re-save the in-memory (fused) tensors under their transformers-5 names; same logits."""
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    for f in tiny_mixtral.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(fused / "model.safetensors"))
    a = prefill_logits(LLM(str(tiny_mixtral), kv_cache_memory_bytes=8 << 20).engine, PROMPTS[:1])
    b = prefill_logits(LLM(str(fused), kv_cache_memory_bytes=8 << 20).engine, PROMPTS[:1])
    EXACT.assert_close(a, b)


def test_missing_expert_is_reported(tiny_mixtral, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_mixtral.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_mixtral / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing 1 tensors.*experts\\[5.up\\]"):
        LLM(str(broken), kv_cache_memory_bytes=8 << 20)
