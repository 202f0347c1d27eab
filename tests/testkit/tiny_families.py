"""Tiny random-weight checkpoints of every supported architecture family, written with transformers'
own config and model classes, and transformers' greedy reference for them. Shared by the offline
engine tests (tests/workers/models) and the ``duet serve`` test (tests/e2e/test_model_families_e2e.py).

CASES: case name -> (model_type, config overrides on top of TINY), each with the family's special
options switched on (q/k norms, YaRN, LongRoPE, sliding windows shorter than PROMPTS[1],
soft-capping, alternating local/global layers, MLA with routed + shared experts, group-limited
routing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152)

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
    """transformers' greedy ``generate`` of exactly ``n`` tokens (EOS ignored) on the checkpoint at ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()
