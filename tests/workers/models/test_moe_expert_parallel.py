"""The new MoE families under expert parallelism: an EP=2 gang (real processes, gloo; each rank
holds half the routed experts, shared experts and MLA replicated) gives transformers' greedy tokens."""

from __future__ import annotations

import pytest

from tests.workers.models.conftest import hf_generate
from tests.workers.models.moe_ep_cases import ep_generate_rank
from tests.workers.models.test_architectures import CASES, NEW, PROMPTS
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3-mla-grouped", "deepseek_v2-mla"])
def test_ep2_matches_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    out, rest = spawn_gang(ep_generate_rank, ParallelConfig(ep_size=2), args=(str(path), PROMPTS, NEW))
    assert rest is None
    assert out == [hf_generate(path, p, NEW) for p in PROMPTS]
