"""The inverse-CDF draw (workers/sample/draw.py) and the sampler's batched fast paths against plain
references: the two-level search equals a float64 prefix sum over the whole row; tokens of
probability 0 are never drawn; draws follow the distribution; a batched draw equals each row drawn
alone; the sampler's skip-the-work paths (all greedy, plain temperature) give the tokens the full
processing path gives for the same rows."""

from __future__ import annotations

import pytest
import torch

from testkit.tolerance import estimate
from workers.sample.draw import BLOCK, draw, search, uniforms
from workers.sample.penalties import RowContext
from workers.sample.sampler import Sampler
from workers.sampling_params import SamplingParams


def _assert_matches_reference(probs: torch.Tensor, u: torch.Tensor, got: list[int]) -> None:
    """Each draw is the first t with sum(p[:t+1]) > u * sum(p) by a float64 prefix sum over the whole
    row, except where u * sum(p) lies within the block sums' float32 rounding (B * 2^-24 of the mass
    up to there) of a block boundary, where the token on either side is right."""
    cdf = probs.double().cumsum(-1)
    mismatches = 0
    for i, t in enumerate(got):
        x = float(u[i] * cdf[i, -1])
        want = int(torch.searchsorted(cdf[i], x, right=True))
        if t != want:
            edge = min(t, want) // BLOCK * BLOCK + BLOCK - 1  # the last token of the lower block
            assert abs(float(cdf[i, edge]) - x) <= BLOCK * 2**-24 * float(cdf[i, edge]), (i, t, want)
            mismatches += 1
    assert mismatches <= 1


@pytest.mark.parametrize("V", [7, BLOCK, 3 * BLOCK + 5, 49152])
def test_search_equals_a_whole_row_prefix_sum(V):
    g = torch.Generator().manual_seed(V)
    probs = torch.rand(64, V, generator=g) ** 4
    probs[probs < 0.05] = 0.0  # runs of zeros, also whole blocks of them
    probs[:, : V // 2][torch.rand(64, V // 2, generator=g) < 0.5] = 0.0
    probs[:, 0] += 1e-3  # every row has mass
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-17], dtype=torch.float64)
    got = search(probs, u)
    _assert_matches_reference(probs, u, got)
    assert all(probs[i, t] > 0 for i, t in enumerate(got))


def test_zero_probability_tokens_are_never_drawn_at_the_boundaries():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.25, 0.0, 0.25, 0.0]] * 6)
    u = torch.tensor([0.0, 0.5, 0.5 - 1e-16, 0.75, 0.75 + 1e-16, 1 - 2**-53], dtype=torch.float64)
    assert search(p, u) == [1, 4, 1, 6, 6, 6]


def test_draws_follow_the_distribution():
    """60,000 draws over 6 tokens: each frequency's standard error is <= sqrt(.25/60000) = 0.002, so
    0.01 (5 standard errors) passes the right rule and fails one off by a token's share."""
    p = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    g = torch.Generator().manual_seed(0)
    u = torch.rand(60_000, generator=g, dtype=torch.float64)
    tokens = torch.tensor(search(p.expand(60_000, -1), u))
    freq = torch.bincount(tokens, minlength=6).double() / 60_000
    assert freq.tolist() == estimate(p.double().tolist(), abs=0.01, why="5 standard errors of a frequency over 60,000 draws")
    assert freq[2] == 0


def test_batched_draw_equals_each_row_alone():
    """Seeded rows draw from their own generators whatever the batch; rows sharing one generator
    (the engine's default, for unseeded requests) take its numbers in row order."""
    probs = torch.rand(5, 300, generator=torch.Generator().manual_seed(1))
    shared = torch.Generator().manual_seed(99)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)] + [shared, torch.Generator().manual_seed(3), shared]
    batched = draw(probs, gens)
    shared.manual_seed(99)
    alone = [draw(probs[i : i + 1], [g])[0] for i, g in enumerate(
        [torch.Generator().manual_seed(s) for s in (1, 2)] + [shared, torch.Generator().manual_seed(3), shared])]
    assert batched == alone
    shared.manual_seed(99)
    assert uniforms([shared, shared]).tolist() == torch.rand(2, generator=torch.Generator().manual_seed(99),
                                                             dtype=torch.float64).tolist()


V = 512
EOS = frozenset({2})


def _rows(params: list[SamplingParams]) -> list[RowContext]:
    return [RowContext(p, [5, 6, 7, 5, 9], 3, 2) for p in params]


def _sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return Sampler(EOS)(logits, _rows(params), gens)


def test_plain_temperature_fast_path_equals_the_processing_path():
    """Rows that ask for nothing but a temperature skip the processing copy and the filter passes;
    the same rows beside one that forces every pass (penalties, bias, min_tokens, logprobs, min-p,
    top-k, top-p) get the same tokens."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2)) * 3
    plain = [SamplingParams(temperature=t) for t in (0.7, 1.0, 1.3, 0.0, 2.0)]
    forcing = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01, presence_penalty=0.5,
                             repetition_penalty=1.2, logit_bias={7: 1.0}, min_tokens=4, top_logprobs=2)
    seeds = [11, 12, 13, 14, 15, 16]
    fast, lps = _sample(logits[:5], plain, seeds[:5])
    full, _ = _sample(logits, plain + [forcing], seeds)
    assert fast == full[:5]
    assert lps == [None] * 5


def test_all_greedy_fast_path_equals_greedy_rows_of_a_mixed_batch():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    greedy = [SamplingParams(temperature=0.0)] * 3
    fast, _ = _sample(logits[:3], greedy, [1, 2, 3])
    mixed, _ = _sample(logits, greedy + [SamplingParams(temperature=1.0, top_logprobs=1)], [1, 2, 3, 4])
    assert fast == mixed[:3] == logits[:3].argmax(-1).tolist()


def test_sampler_rows_reproduce_in_any_batch():
    """Each seeded row of a mixed batch gets the token it gets alone (its own generator, its own
    settings), in both orders."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=1.1, top_k=30), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.6, min_p=0.05, top_logprobs=3)]
    seeds = [21, 22, 23, 24, 25]
    batched, _ = _sample(logits, params, seeds)
    alone = [_sample(logits[i : i + 1], [params[i]], [seeds[i]])[0][0] for i in range(5)]
    assert batched == alone
    rev, _ = _sample(logits.flip(0), params[::-1], seeds[::-1])
    assert rev[::-1] == batched


def test_a_row_without_filters_is_untouched_by_its_neighbours_filters():
    """Each filter pass runs on the rows that set it only: a plain row's weights are bit-identical
    alone and beside rows with min-p / top-k / top-p (so its draw cannot depend on the batch)."""
    from workers.sample.sampler import sampling_weights

    logits = torch.randn(4, 4096, generator=torch.Generator().manual_seed(5)) * 4
    plain = SamplingParams(temperature=0.9)
    alone = sampling_weights(logits[:1], [plain])
    crowd = sampling_weights(logits, [plain, SamplingParams(temperature=0.9, top_p=0.5),
                                      SamplingParams(temperature=0.9, top_k=5), SamplingParams(min_p=0.1)])
    assert torch.equal(alone[0], crowd[0])
    assert (crowd[2] > 0).sum() == 5 and (crowd[0] > 0).sum() == 4096
