"""Rank functions for the tensor/sequence-parallel tests (module-level so spawned ranks import them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from testkit.ep_cases import generate
from testkit.mixtral_tiny import prefill_logits
from workers.llm import LLM, engine_config
from workers.engine.model_runner import ModelRunner
from workers.engine.gang_runner import GangRunner, follow
from workers.parallel.groups import get_group

TINY_QWEN2 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152, tie_word_embeddings=False)


def save_tiny_qwen2(out: Path, smollm2_path: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen2 (q/k/v biases, untied head) with SmolLM2's tokenizer; biases random too.
    ``overrides``: config fields to change in TINY_QWEN2."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **{**TINY_QWEN2, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    for f in smollm2_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


SMALL = {"kv_cache_memory_bytes": 8 << 20, "block_size": 8, "max_num_batched_tokens": 32}


def make_llm(path: str, **kw) -> LLM:
    return LLM(path, **{**SMALL, **kw})


def make_runner(path: str, **kw) -> ModelRunner:
    """This rank's ModelRunner with make_llm's settings (its shard of the model inside a gang)."""
    return ModelRunner.from_config(engine_config(path, **{**SMALL, **kw}))


def run_gang(runner: ModelRunner, rank: int, prompts: list[list[int]], max_tokens: int, path: str,
             **kw) -> list[list[int]] | None:
    """Greedy generation with gang rank 0's engine (built over the GangRunner) scheduling and
    broadcasting each step; None on followers. kw: make_llm settings, as the runner was made."""
    if rank != 0:
        follow(runner, get_group("gang"))
        return None
    gang = GangRunner(runner, get_group("gang"))
    try:
        return generate(make_llm(path, runner=gang, **kw).engine, prompts, max_tokens)
    finally:
        gang.stop()


def tp_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int) -> dict | None:
    """All-position logits of a batched prefill (tp rank 0), the KV cache shape, then gang generation."""
    runner = make_runner(path)
    logits = prefill_logits(runner, prompts)  # collective: every tp rank computes its vocab slice
    kv_shape = list(runner.kv_cache.shape)
    tokens = run_gang(runner, rank, prompts, max_tokens, path)
    transport = transports()
    if rank != 0:
        assert logits is None
        return {"kv_shape": kv_shape, "transport": transport}
    return {"logits": logits.numpy(), "tokens": tokens, "kv_shape": kv_shape, "transport": transport}


def transports() -> dict[str, str]:
    """What carried each axis's collectives on this rank ('shm', 'gloo' or 'none')."""
    return {axis: get_group(axis).transport for axis in ("tp", "sp")}
