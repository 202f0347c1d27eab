"""Every architecture family against transformers: a tiny random checkpoint (conftest.save_tiny)
with the family's special options switched on gives the same greedy tokens through the offline
engine as transformers' ``generate``. The prompts are longer than every sliding window and cross
the block size, and prefill runs in several chunks, so windows, chunked prefill and decode all run."""

from __future__ import annotations

import pytest

from tests.workers.models.conftest import hf_generate
from workers.llm import LLM
from workers.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 190))]  # 6 and 90 tokens
NEW = 12
HD = dict(head_dim=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, num_key_value_heads=4)

CASES = {
    "qwen3-qknorm-yarn": ("qwen3", {**HD, "rope_parameters": YARN, "tie_word_embeddings": False}),
    "qwen3-sliding": ("qwen3", {**HD, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                                "layer_types": ["full_attention", "sliding_attention"]}),
    "mistral-sliding": ("mistral", {**HD, "sliding_window": 8}),
    "gemma2-softcap": ("gemma2", {**HD, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                  "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3-local-global": ("gemma3_text", {
        **HD, "query_pre_attn_scalar": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}),
    "phi3-longrope": ("phi3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "long_factor": [1.0, 2.0, 4.0, 8.0, 9, 10, 11, 12]}}),
    "phi3-sliding": ("phi3", {"sliding_window": 8}),
    "qwen3_moe": ("qwen3_moe", {**HD, **MOE, "norm_topk_prob": True}),
    "deepseek_v3-mla-grouped": ("deepseek_v3", {
        **MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "num_hidden_layers": 3, "routed_scaling_factor": 2.5,
        "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "deepseek_v2-mla": ("deepseek_v2", {
        **MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 1.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    assert llm.engine.spec.model_type == arch
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_generate(path, prompt, NEW), (case, prompt[:4])
