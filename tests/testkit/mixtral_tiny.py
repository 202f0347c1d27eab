"""Tiny random Mixtral checkpoints for MoE tests (real model code and loading paths; only the
weights are random, since no MoE weights exist offline), and a helper that runs one prefill
through an engine's runner and returns every position's logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_MIXTRAL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152,
                    num_local_experts=8, num_experts_per_tok=2)


def save_tiny_mixtral(out: Path, smollm2_path: Path, seed: int = 0, router_scale: float = 40.0, **extra) -> Path:
    """Save a random MixtralForCausalLM (transformers' own save format) with SmolLM2's tokenizer.
    Router weights are scaled up so routing is decisive and uneven (HF's init is nearly uniform,
    which would make top-k choices hinge on last-bit differences)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**TINY_MIXTRAL, **extra})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(router_scale)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
            layer.mlp.experts.down_proj.normal_(0, 0.1)
    model.save_pretrained(out)
    for f in smollm2_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@torch.inference_mode()
def prefill_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """All positions' logits [sum(len), V] of a fresh prefill of ``prompts`` in one step (uses the
    engine's ModelRunner -- or the ModelRunner passed as ``engine`` -- and its KV cache directly:
    call on an idle engine)."""
    from workers.engine.scheduler import ScheduledChunk

    runner = getattr(engine, "runner", engine)
    bs = runner.block_size
    chunks, next_block = [], 0
    for i, ids in enumerate(prompts):
        n = -(-len(ids) // bs)
        chunks.append(ScheduledChunk(f"p{i}", list(ids), 0, list(range(next_block, next_block + n)), True))
        next_block += n
    input_ids, positions, meta, _ = runner._prepare(chunks, 0)
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)  # [T, E]
    return runner.model.compute_logits(hidden)  # [T, V]
