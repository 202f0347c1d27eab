"""Sequence parallelism as real processes (gloo): SP gangs against the single-process engine.

A 90-token prompt is prefilled as two chunks (40 + 50 tokens; the second attends to the first
through the KV cache), each split zigzag over the sp ranks and attended by ring attention
(workers/layers/ring_attention.py). Checked:
  - every position's logits, assembled from the ranks' pieces, equal SP=1's (fp32 tolerance: the
    partial softmaxes are merged by log-sum-exp instead of one pass);
  - every rank's KV cache holds the whole prompt's K/V (what decode needs), equal to SP=1's;
  - greedy generation as a gang (rank 0 schedules; prompts of 50 and 90 tokens prefilled in
    32-token chunks split over the ranks, then replicated decode) gives SP=1's tokens.
Cases: SmolLM2 (real weights) at SP=2, and TP=2 x SP=2 (4 ranks) on a tiny random Qwen2 with
biases, where each tp rank rings only its own kv heads. The ranks share this host, so the ring and
the all-reduces run on shared memory (required via comm=shm); SmolLM2's case also on gloo."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.sp_cases import single_rank_reference, sp_rank
from testkit.tp_cases import save_tiny_qwen2
from workers.layers import ring_attention
from workers.layers.ring_attention import full_attention_lse, zigzag_pieces
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang

from testkit.tolerance import KERNEL_FP32, SHARDED_FP32, RING_ATTENTION_FP32

PROMPT = [(i * 37 + 11) % 4000 + 20 for i in range(90)]
CUT = 40
PROMPTS = [list(range(100, 150)), PROMPT, [7, 8]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("sp") / "qwen2", smollm2_path, seed=3)


def _check(path: Path, config: ParallelConfig, comm: str = "shm") -> None:
    ref = single_rank_reference(str(path), PROMPT, CUT, PROMPTS, MAX_TOKENS)
    assert ref["positions"] == list(range(len(PROMPT)))
    results = spawn_gang(sp_rank, config, args=(str(path), PROMPT, CUT, PROMPTS, MAX_TOKENS), comm=comm)
    assert all(r["transport"]["sp"] == comm for r in results)  # the ring ran on shared memory (or gloo)
    tp = config.tp_size
    by_position = np.full_like(ref["logits"], np.nan)
    sp_ranks = [results[i * tp] for i in range(config.sp_size)]  # tp rank 0 of each sp rank holds logits
    for r in sp_ranks:
        by_position[r["positions"]] = r["logits"]
    assert sorted(p for r in sp_ranks for p in r["positions"]) == list(range(len(PROMPT)))  # split, not copied
    RING_ATTENTION_FP32.assert_close(by_position, ref["logits"])
    g = ref["kv"].shape[3]
    for i, r in enumerate(results):  # every rank caches the whole prompt for its kv heads
        heads = slice((i % tp) * g // tp, (i % tp + 1) * g // tp)
        SHARDED_FP32.assert_close(r["kv"], ref["kv"][:, :, :, heads])
    assert results[0]["tokens"] == ref["tokens"]


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_sp2_smollm2_matches_sp1(smollm2_path, comm):
    _check(smollm2_path, ParallelConfig(sp_size=2), comm)


def test_tp2_sp2_qwen2_matches_single_rank(qwen2):
    _check(qwen2, ParallelConfig(sp_size=2, tp_size=2))


def test_zigzag_pieces_balance_causal_work():
    assert zigzag_pieces(90, 2) == [23, 23, 22, 22] and sum(zigzag_pieces(8000, 2)) == 8000
    sizes = zigzag_pieces(4000, 4)
    ends = np.cumsum(sizes)
    # causal work of piece i ~ its rows x the keys up to its end; rank r holds pieces r and 2W-1-r
    work = [sizes[r] * ends[r] + sizes[7 - r] * ends[7 - r] for r in range(4)]
    assert max(work) / min(work) < 1.01


def test_full_attention_lse_matches_softmax(monkeypatch):
    monkeypatch.setattr(ring_attention, "QUERY_BLOCK", 16)  # several query blocks, a partial last one
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(37, 6, 8, generator=g), torch.randn(50, 2, 8, generator=g), torch.randn(50, 2, 8, generator=g)
    out, lse = full_attention_lse(q, k, v, 0.3)
    kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)  # [50, 6, 8]: GQA groups of 3
    s = torch.einsum("nhd,mhd->hnm", q, kk) * 0.3
    KERNEL_FP32.assert_close(lse, torch.logsumexp(s, -1).T)
    KERNEL_FP32.assert_close(out, torch.einsum("hnm,mhd->nhd", s.softmax(-1), vv))
