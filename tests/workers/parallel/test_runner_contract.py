"""The Runner contract (workers/engine/runner.py): one engine-level suite run against a ModelRunner in
this process and against GangRunners of real gangs (spawned processes over gloo): layout and sizes,
greedy and seeded generation, an exact KV round trip through write_blocks/read_blocks, the sampling
generator's state, and a disaggregated hand-off from the engine to itself. Every runner must pass
the suite and agree with the single-process runner (tokens identical; exported KV to fp32
rounding, since TP sums partial products in another order). Shapes: SmolLM2 at TP=2 (uneven kv
head shards 2 + 1), a tiny Qwen2 at TP=4 (2 kv heads, each replicated on two ranks) and a tiny
Mixtral at EP=2 and a tiny Qwen2 at SP=2 (attention replicated on both ranks: the leader reads its
own cache, every rank is written the whole KV)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.pd_cases import build, contract_rank, contract_suite, max_rel_diff
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang

from testkit.tolerance import SHARDED_FP32

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 150)), [7, 8]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    from testkit.mixtral_tiny import save_tiny_mixtral
    from testkit.tp_cases import save_tiny_qwen2

    root = tmp_path_factory.mktemp("contract")
    return {"smollm2": smollm2_path, "qwen2": save_tiny_qwen2(root / "qwen2", smollm2_path),
            "mixtral": save_tiny_mixtral(root / "mixtral", smollm2_path, seed=3)}


def _check(result: dict, single: dict) -> None:
    assert result["round_trip"] and result["gen_ok"] and result["no_seed"]
    assert result["tokens"] == single["tokens"]
    assert result["handoff_tokens"] == result["tokens"]  # exported, then imported: the same continuation
    assert max_rel_diff(result["export_kv"], single["export_kv"], list(map(len, PROMPTS))) <= SHARDED_FP32.rmax


@pytest.mark.parametrize("model, parallel", [("smollm2", ParallelConfig(tp_size=2)),
                                             ("qwen2", ParallelConfig(tp_size=4)),
                                             ("mixtral", ParallelConfig(ep_size=2)),
                                             ("qwen2", ParallelConfig(sp_size=2))],
                         ids=["smollm2-tp2", "qwen2-tp4-replicated-kv", "mixtral-ep2", "qwen2-sp2"])
def test_gang_runner_passes_the_model_runner_suite(models, model, parallel):
    path = str(models[model])
    engine, _ = build(path)
    single = contract_suite(engine, PROMPTS, MAX_TOKENS)
    _check(single, single)  # the ModelRunner passes its own suite
    if model == "mixtral":
        assert sum(single["moe"][0]) > 0
    result = spawn_gang(contract_rank, parallel, args=(path, PROMPTS, MAX_TOKENS))[0]
    _check(result, single)
    if model == "mixtral":
        assert result["moe"][0] == single["moe"][0]  # the leader routed the same tokens to the same experts
