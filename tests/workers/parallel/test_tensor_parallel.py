"""Tensor parallelism as real processes (gloo): TP gangs against the single-process engine.

Each gang computes the all-position logits of a batched prefill and then greedy continuations
with rank 0 scheduling and broadcasting each step (workers/engine/gang_runner.py), the LM head
gathering the sampled rows' logits to rank 0. Cases:
  - SmolLM2 (real weights; 9 query heads, 3 kv heads) at TP=2: GQA groups stay whole, so the split
    is uneven (rank 0: 2 kv heads / 6 query heads, rank 1: 1 / 3) and the KV cache of each rank
    holds only its kv heads;
  - a tiny random Qwen2 (q/k/v biases, untied LM head) at TP=2 (even split) and TP=4 (4 query
    heads, 2 kv heads: each kv head replicated on two ranks).
Tolerance: the row-parallel all-reduce sums partial products in another order than one GEMM, so
logits agree to fp32 rounding (1e-4 relative to their scale), and greedy tokens must be identical.
Transport: the ranks share this host, so the tp collectives run on shared memory (comm=shm
makes that a requirement, and each rank reports it); the Qwen2 TP=2 case also runs on gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.ep_cases import generate
from testkit.mixtral_tiny import prefill_logits
from testkit.tp_cases import make_llm, save_tiny_qwen2, tp_rank
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang

from testkit.tolerance import SHARDED_FP32

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 150)), [7, 8]]  # 50 tokens: chunked (budget 32)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tp") / "qwen2", smollm2_path)


def _single(path: Path) -> dict:
    llm = make_llm(str(path))
    return {"logits": prefill_logits(llm.engine, PROMPTS).numpy(), "tokens": generate(llm.engine, PROMPTS, MAX_TOKENS),
            "kv_shape": list(llm.engine.runner.kv_cache.shape)}


def _check(path: Path, tp: int, single: dict, comm: str = "shm") -> list[dict]:
    results = spawn_gang(tp_rank, ParallelConfig(tp_size=tp), args=(str(path), PROMPTS, MAX_TOKENS), comm=comm)
    assert all(r["transport"]["tp"] == comm for r in results)
    out = results[0]
    SHARDED_FP32.assert_close(out["logits"], single["logits"])
    assert out["tokens"] == single["tokens"]
    return results


def test_tp2_smollm2_uneven_heads_matches_tp1(smollm2_path):
    single = _single(smollm2_path)
    results = _check(smollm2_path, 2, single)
    layers, two, slots, g, d = single["kv_shape"]
    assert g == 3
    assert [r["kv_shape"][3] for r in results] == [2, 1]  # each rank caches its own kv heads only
    assert all(r["kv_shape"][2] == results[0]["kv_shape"][2] for r in results)  # same block count


@pytest.mark.parametrize("tp, comm", [(2, "shm"), (2, "gloo"), (4, "shm")],
                         ids=["tp2-shm", "tp2-gloo", "tp4-replicated-kv-shm"])
def test_tp_qwen2_biases_matches_tp1(qwen2, tp, comm):
    results = _check(qwen2, tp, _single(qwen2), comm)
    assert [r["kv_shape"][3] for r in results] == [1] * tp
