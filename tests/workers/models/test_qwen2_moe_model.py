"""Qwen2-MoE (workers/models/qwen2_moe.py) against HF transformers' Qwen2MoeForCausalLM on a tiny
random checkpoint with every feature on: q/k/v biases, routed experts without renormalisation
(norm_topk_prob=False), a gated shared expert, and a dense MLP layer (mlp_only_layers). Logits of a
batched prefill within fp32 tolerance and greedy tokens equal, on one rank and as an EP=2 gang."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from testkit.ep_cases import ep_rank
from testkit.mixtral_tiny import prefill_logits
from workers.llm import LLM
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang
from workers.sampling_params import SamplingParams

from testkit.tolerance import MODEL_FP32

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 140)), [7]]


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory, smollm2_path) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
                         shared_expert_intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                         mlp_only_layers=[1], max_position_embeddings=512, vocab_size=49152, tie_word_embeddings=False)
    model = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(40)  # decisive, uneven routing
            elif ".experts." in name or "shared_expert" in name:
                p.normal_(0, 0.1)
    out = tmp_path_factory.mktemp("qwen2moe") / "tiny"
    model.save_pretrained(out)
    for f in smollm2_path.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return out


def test_matches_hf(tiny_qwen2_moe):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_moe, dtype=torch.float32).eval()
    llm = LLM(str(tiny_qwen2_moe), kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    spec = llm.engine.spec
    assert (spec.model_type, spec.attention_bias, spec.norm_topk_prob, spec.dense_mlp_layers) == ("qwen2_moe", True, False, (1,))
    assert len(llm.engine.runner.model.moe_layers()) == 2
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    MODEL_FP32.assert_close(prefill_logits(llm.engine, PROMPTS), ref)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.token_ids == want[0, len(prompt):].tolist()


def test_ep2_matches_single_rank(tiny_qwen2_moe):
    from testkit.ep_cases import generate, make_llm

    single = make_llm(str(tiny_qwen2_moe))
    logits = prefill_logits(single.engine, PROMPTS).numpy()
    tokens = generate(single.engine, PROMPTS, 8)
    [out, _] = spawn_gang(ep_rank, ParallelConfig(ep_size=2), args=(str(tiny_qwen2_moe), PROMPTS, 8, 2))
    MODEL_FP32.assert_close(out["logits"], logits)
    assert out["tokens"] == tokens
