"""Rank functions for the expert-parallel tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import torch

from testkit.mixtral_tiny import prefill_logits
from workers.llm import LLM, engine_config
from workers.engine.model_runner import ModelRunner
from workers.parallel.expert_placement import ExpertPlacement
from workers.engine.gang_runner import GangRunner, follow
from workers.parallel.groups import get_group
from workers.sampling_params import SamplingParams


SMALL = {"kv_cache_memory_bytes": 8 << 20, "block_size": 8, "max_num_batched_tokens": 32}


def make_llm(path: str, **kw) -> LLM:
    return LLM(path, **SMALL, **kw)


def make_runner(path: str) -> ModelRunner:
    return ModelRunner.from_config(engine_config(path, **SMALL))


def generate(engine, prompts: list[list[int]], max_tokens: int, on_step=None) -> list[list[int]]:
    """Greedy tokens per prompt, stepping the engine by hand; on_step(i) runs before step i."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    step = 0
    while engine.has_unfinished():
        if on_step is not None:
            on_step(step)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return [tokens[i] for i in ids]


def replicated_placements(model, world: int) -> list[ExpertPlacement]:
    """Every layer: each rank also holds the first expert of the next rank's block (a forced plan)."""
    plans = []
    for layer in model.moe_layers():
        per = layer.num_experts // world
        plans.append(layer.home.with_replicas({((r + 1) % world) * per: [r] for r in range(world)}))
    return plans


def ep_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int, rebalance_at: int | None) -> dict | None:
    """Logits of a batched prefill, rank loads of a 1-token step, then greedy generation as a gang
    (optionally switching to replicated placements before step ``rebalance_at``)."""
    runner = make_runner(path)
    group = get_group("ep")
    logits = prefill_logits(runner, prompts)
    layers = runner.model.moe_layers()
    before = torch.stack([layer.rank_rows.clone() for layer in layers])
    one = prefill_logits(runner, [[7]])
    one_token_rows = (torch.stack([layer.rank_rows for layer in layers]) - before).tolist()  # [layers, W]
    if rank != 0:
        follow(runner, get_group("gang"))
        return None
    gang = GangRunner(runner, get_group("gang"))
    llm = make_llm(path, runner=gang)

    def on_step(i: int) -> None:
        if i == rebalance_at:
            gang.rebalance(replicated_placements(runner.model, group.world_size))

    tokens = generate(llm.engine, prompts, max_tokens, on_step)
    gang.stop()
    return {"logits": logits.numpy(), "one": one.numpy(), "one_token_rows": one_token_rows, "tokens": tokens,
            "slots": [len(layer.placement.slots(0)) for layer in layers]}


def ep_auto_rebalance_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int) -> dict | None:
    """Greedy generation as a gang whose leader runs the Rebalancer every 2 steps (threshold 1.0:
    any imbalance triggers it), as a serving gang does between steps."""
    from workers.parallel.eplb import RebalanceConfig, Rebalancer

    runner = make_runner(path)
    if rank != 0:
        follow(runner, get_group("gang"))
        return None
    layers = runner.model.moe_layers()
    reb = Rebalancer(layers, RebalanceConfig(interval_steps=2, max_extra_per_rank=1, threshold=1.0))
    gang = GangRunner(runner, get_group("gang"), reb)
    tokens = generate(make_llm(path, runner=gang).engine, prompts, max_tokens)
    gang.stop()
    return {"tokens": tokens, "rebalances": reb.num_rebalances,
            "replicas": sum(len(r) - 1 for layer in layers for r in layer.placement.replicas)}
