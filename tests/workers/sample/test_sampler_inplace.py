"""Sampler's in-place weights (the [N, V] tensor it overwrites when it is its own copy: the fp32
copy of bf16 logits, a subset of rows) draw exactly what the out-of-place path draws: the same
seeded tokens from bf16 logits as from the same values in fp32 (whose tensor is the caller's and
is left untouched), with and without greedy rows, filters and logprobs in the batch."""

from __future__ import annotations

import pytest
import torch

from workers.sample.penalties import RowContext
from workers.sample.sampler import Sampler
from workers.sampling_params import SamplingParams

V = 1000


def _rows(params: list[SamplingParams]) -> list[RowContext]:
    return [RowContext(p, [1, 2, 3], 3, 0) for p in params]


@pytest.mark.parametrize("mix", ["all_sampled", "with_greedy", "with_filters", "with_logprobs"])
def test_bf16_logits_draw_what_their_fp32_values_draw(mix: str) -> None:
    n = 6
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=4) for i in range(n)]
    if mix == "with_greedy":
        params[2] = SamplingParams(temperature=0.0, max_tokens=4)
    if mix == "with_filters":
        params[1] = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=7, max_tokens=4)
    if mix == "with_logprobs":
        params[0] = SamplingParams(temperature=1.0, seed=3, top_logprobs=2, max_tokens=4)
    logits16 = (torch.randn(n, V, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    logits32 = logits16.float()
    before = logits32.clone()
    got = {}
    for name, logits in (("bf16", logits16), ("fp32", logits32)):
        gens = [torch.Generator().manual_seed(p.seed or 0) for p in params]
        got[name] = Sampler()(logits, _rows(params), gens)
    assert got["bf16"][0] == got["fp32"][0]
    assert [lp and lp.logprob for lp in got["bf16"][1]] == [lp and lp.logprob for lp in got["fp32"][1]]
    assert torch.equal(logits32, before)  # the caller's tensor is not overwritten
