"""Rank function for the MoE-architecture expert-parallel tests (module-level so spawned ranks import it)."""

from __future__ import annotations

from workers.llm import LLM, engine_config
from workers.engine.model_runner import ModelRunner
from workers.engine.gang_runner import GangRunner, follow
from workers.parallel.groups import get_group
from workers.sampling_params import SamplingParams

_SMALL = dict(kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)


def ep_generate_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]] | None:
    """Greedy tokens of ``prompts`` from a gang (rank 0 schedules and broadcasts each step)."""
    runner = ModelRunner.from_config(engine_config(path, **_SMALL))
    if rank != 0:
        follow(runner, get_group("gang"))
        return None
    gang = GangRunner(runner, get_group("gang"))
    llm = LLM(path, runner=gang, **_SMALL)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens[out.request_id] += out.new_token_ids
    gang.stop()
    return [tokens[i] for i in ids]
