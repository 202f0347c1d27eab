"""Disaggregated prefill/decode on the new attention variants: MLA (the exported and imported
blocks hold the latent rows) and Gemma 2's sliding-window + soft-capped layers. A prefill engine
exports, a decode engine imports and decodes; tokens equal transformers' greedy ones."""

from __future__ import annotations

import pytest

from tests.workers.models.conftest import hf_generate
from tests.workers.models.test_architectures import CASES, NEW, PROMPTS
from tests.workers.engine.test_disagg_engine import disagg_run
from workers.llm import LLM
from workers.sampling_params import SamplingParams


@pytest.mark.parametrize("case", ["deepseek_v3-mla-grouped", "gemma2-softcap"])
def test_disaggregated_matches_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    kw = dict(kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    prefill, decode = LLM(str(path), **kw).engine, LLM(str(path), **kw).engine
    params = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)] * len(PROMPTS)
    tokens, blocks = disagg_run(prefill, decode, PROMPTS, params)
    assert all(n > 0 for n in blocks)
    assert tokens == [hf_generate(path, p, NEW) for p in PROMPTS]


def test_mla_transfer_is_the_latent(tiny_checkpoint):
    """What travels for MLA is the compressed latent [c_kv | k_pe] per token and layer, not per-head
    K/V: the export's bytes are layers x slots x (kv_lora_rank + qk_rope_head_dim) x itemsize."""
    from tests.workers.models.conftest import TINY

    arch, o = CASES["deepseek_v3-mla-grouped"]
    path = tiny_checkpoint(arch, **o)
    prefill = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=8).engine
    prompt = PROMPTS[1]
    prefill.add_request("m", prompt, SamplingParams(temperature=0, max_tokens=1), export_from_block=0)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    [out] = outs
    kv = out.kv_export.kv  # [L, 2, n, bs, G, D]
    slots = -(-len(prompt) // 8) * 8
    latent = o["kv_lora_rank"] + o["qk_rope_head_dim"]
    assert kv.numel() * kv.element_size() == o["num_hidden_layers"] * slots * latent * 4  # fp32 latents
    heads = TINY["num_attention_heads"]
    assert latent < heads * (o["qk_nope_head_dim"] + o["qk_rope_head_dim"] + o["v_head_dim"])  # full K and V
