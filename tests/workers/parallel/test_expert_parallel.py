"""Expert parallelism as real processes (gloo): EP=2 and EP=4 gangs against EP=1 on a tiny random
Mixtral (8 experts, top-2). Each gang computes the logits of a batched prefill (every rank holds
only its experts; tokens travel by all-to-all), a 1-token step (so some ranks receive no tokens
at all), and greedy continuations with rank 0 scheduling and broadcasting each step; optionally it
switches mid-generation to a placement with replicated experts (rebalancing), which must not
change a single token.

Tolerance: each expert's rows pass through the same kernels on every rank, but the grouped GEMM
picks GEMV or MKL by group size, which differs between EP sizes, so logits agree to fp32 rounding
(1e-4) rather than bit for bit; greedy tokens must be identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.ep_cases import ep_auto_rebalance_rank, ep_rank, generate, make_llm
from testkit.mixtral_tiny import prefill_logits, save_tiny_mixtral
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang

from testkit.tolerance import MODEL_FP32

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 137)), [7, 8]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_mixtral(tmp_path_factory.mktemp("ep") / "tiny", smollm2_path, seed=1)


@pytest.fixture(scope="module")
def single(tiny) -> dict:
    llm = make_llm(str(tiny))
    return {
        "logits": prefill_logits(llm.engine, PROMPTS).numpy(),
        "one": prefill_logits(llm.engine, [[7]]).numpy(),
        "tokens": generate(llm.engine, PROMPTS, MAX_TOKENS),
    }


@pytest.mark.parametrize("ep_size,rebalance_at", [(2, None), (4, None), (2, 3)], ids=["ep2", "ep4", "ep2-rebalance"])
def test_ep_matches_single_rank(tiny, single, ep_size, rebalance_at):
    results = spawn_gang(ep_rank, ParallelConfig(ep_size=ep_size), args=(str(tiny), PROMPTS, MAX_TOKENS, rebalance_at))
    out = results[0]
    assert all(r is None for r in results[1:])
    MODEL_FP32.assert_close(out["logits"], single["logits"])
    MODEL_FP32.assert_close(out["one"], single["one"])
    assert out["tokens"] == single["tokens"]
    # the 1-token step: 2 assignments per layer, so at least ep_size - 2 ranks computed nothing
    assert all(sum(rows) == 2 and rows.count(0) >= ep_size - 2 for rows in out["one_token_rows"])
    per_rank = 8 // ep_size
    assert out["slots"] == [per_rank + (1 if rebalance_at is not None else 0)] * 2


def test_leader_rebalances_between_steps_without_changing_tokens(tiny, single):
    [out, _] = spawn_gang(ep_auto_rebalance_rank, ParallelConfig(ep_size=2), args=(str(tiny), PROMPTS, MAX_TOKENS))
    assert out["rebalances"] >= 1 and out["replicas"] > 0
    assert out["tokens"] == single["tokens"]
