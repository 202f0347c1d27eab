"""Rank function for the MoE-architecture expert-parallel tests (module-level so spawned ranks import it)."""

from __future__ import annotations

from workers.llm import LLM
from workers.parallel.gang import GangLeader, follow
from workers.parallel.groups import get_group
from workers.sampling_params import SamplingParams


def ep_generate_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]] | None:
    """Greedy tokens of ``prompts`` from a gang (rank 0 schedules and broadcasts each step)."""
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    if rank != 0:
        follow(llm.engine.runner, get_group("gang"))
        return None
    leader = GangLeader(llm.engine, get_group("gang"))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens[out.request_id] += out.new_token_ids
    leader.stop()
    return [tokens[i] for i in ids]
