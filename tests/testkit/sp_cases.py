"""Rank functions for the sequence-parallel tests (module-level so spawned ranks import them)."""

from __future__ import annotations

import torch

from testkit.ep_cases import generate
from testkit.tp_cases import make_llm, make_runner, run_gang, transports
from workers.engine.scheduler import ScheduledChunk


@torch.inference_mode()
def two_chunk_prefill(engine, prompt: list[int], cut: int) -> tuple[list[int], torch.Tensor | None]:
    """Prefill ``prompt`` as two chunks [0, cut) and [cut, n) (the second attends to the first
    through the KV cache) on an idle engine; returns this rank's row positions and their logits
    (None on tp ranks > 0). Under SP each rank computes only its pieces of each chunk."""
    runner = getattr(engine, "runner", engine)
    table = list(range(-(-len(prompt) // runner.block_size)))
    positions, logits = [], []
    for c in (ScheduledChunk("p", prompt[:cut], 0, table, False), ScheduledChunk("p", prompt[cut:], cut, table, True)):
        rest, split = runner.sp_split([c])
        ids, pos, meta, _ = runner._prepare(rest, 0, split)
        hidden = runner.model(ids, pos, runner.kv_caches, meta)  # [T, E]
        positions += pos.tolist()
        logits.append(runner.model.compute_logits(hidden))  # [T, V]
    return positions, None if logits[0] is None else torch.cat(logits)


def sp_rank(rank: int, path: str, prompt: list[int], cut: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """Two-chunk prefill logits by position, this rank's KV of the prompt, then gang generation."""
    runner = make_runner(path, kv_cache_memory_bytes=16 << 20)
    positions, logits = two_chunk_prefill(runner, prompt, cut)
    kv = runner.kv_cache[:, :, : len(prompt)].clone()  # [layers, 2, n, G, D]: blocks 0.. hold the prompt
    tokens = run_gang(runner, rank, prompts, max_tokens, path, kv_cache_memory_bytes=16 << 20)
    return {"positions": positions, "logits": None if logits is None else logits.numpy(), "kv": kv.numpy(),
            "tokens": tokens, "transport": transports()}


def single_rank_reference(path: str, prompt: list[int], cut: int, prompts: list[list[int]], max_tokens: int) -> dict:
    llm = make_llm(path, kv_cache_memory_bytes=16 << 20)
    positions, logits = two_chunk_prefill(llm.engine, prompt, cut)
    kv = llm.engine.runner.kv_cache[:, :, : len(prompt)].clone()
    return {"positions": positions, "logits": logits.numpy(), "kv": kv.numpy(),
            "tokens": generate(llm.engine, prompts, max_tokens)}
