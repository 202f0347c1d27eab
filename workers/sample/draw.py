"""Categorical draws by inverse CDF: one uniform from the row's own generator per drawn token.

A row's token is the first index t where the cumulative probability P(<= t) exceeds u * P(all),
u ~ U[0, 1) drawn in float64 from the row's generator. Each token t is chosen exactly when u
falls in an interval of width p[t] / sum(p), so the draw follows p; a token of probability 0
(filtered out by top-k / top-p / min-p or a grammar mask) is never chosen, because the CDF does not
rise there.

Why not ``torch.multinomial``: it draws one exponential per vocabulary entry (the exponential
race), V random numbers and logarithms per row per token, in a Python loop over rows because each
seeded request owns its generator. Here a row costs one scalar draw, and the search is one batched
pass over [N, V] plus [N, V / B] work.

Two levels, so no float32 prefix sum runs over the whole vocabulary (a sequential float32 cumsum of
49k terms is off by up to ~V * 2^-24 of the total mass, more than a rare token's probability):
    1. block sums: the vocabulary in blocks of B tokens, each block's mass summed in float32 (one
       vectorised pass; a float64 reduction is ~50x slower) to relative error <= B * 2^-24, then a
       float64 cumsum over the blocks picks the block where u * total lands;
    2. inside that block: the float64 cumsum of its B probabilities picks the token.
So a token's chance is its probability to within ~1e-5 of its block's mass at the block's two ends
(where a block sum's rounding moves the boundary), and exact to float64 rounding elsewhere.

Reproducibility: the uniforms are drawn per generator, in row order (one call per distinct
generator: a seeded request's own, or the engine's shared default for unseeded rows), so a seeded
request draws the same numbers whatever else is in the batch, and the batched draw equals drawing
each row alone (tests/workers/sample/test_draw.py).

Worked example: p = [0.5, 0, 0.3, 0.2], u = 0.6 -> cumulative [0.5, 0.5, 0.8, 1.0], first > 0.6 is
index 2.

Axes: N rows, V vocabulary, B block width, K blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK = 256  # tokens per first-level block (V / B block sums + B in-block terms per row)


def skip_draws(generator: torch.Generator, n: int) -> None:
    """Advance ``generator`` past the uniforms of ``n`` drawn tokens (a seeded request resumed after
    ``n`` tokens continues with the numbers an unbroken run would draw next)."""
    if n > 0:
        torch.rand(n, generator=generator, dtype=torch.float64)


def uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One U[0, 1) float64 per row from the row's generator, drawn generator by generator in row
    order (rows sharing a generator take consecutive numbers from it): [N]."""
    out = torch.empty(len(generators), dtype=torch.float64)
    rows: dict[int, list[int]] = {}  # id(generator) -> its rows, in order
    gens: dict[int, torch.Generator] = {}
    for i, g in enumerate(generators):
        rows.setdefault(id(g), []).append(i)
        gens[id(g)] = g
    for key, idx in rows.items():
        u = torch.rand(len(idx), generator=gens[key], dtype=torch.float64)
        if len(idx) == 1:
            out[idx[0]] = u[0]
        else:
            out[torch.tensor(idx)] = u
    return out


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """probs [N, V] (rows need not be normalised; each must have positive mass) and a generator
    per row -> one token per row, distributed as that row's probs."""
    n, V = probs.shape
    assert len(generators) == n
    if n == 0:
        return []
    return search(probs, uniforms(generators))


def search(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """probs [N, V] (CPU), u [N] float64 in [0, 1) -> per row the first index t with
    sum(probs[:t+1]) > u * sum(probs)."""
    n, V = probs.shape
    nb = -(-V // BLOCK)
    full = V // BLOCK * BLOCK
    sums = torch.empty(n, nb, dtype=torch.float64)  # [N, K]
    if full:
        sums[:, : full // BLOCK] = probs[:, :full].reshape(n, full // BLOCK, BLOCK).sum(-1)
    if full < V:
        sums[:, -1] = probs[:, full:].sum(-1)
    cdf = sums.cumsum_(-1)  # [N, K]
    x = u[:, None] * cdf[:, -1:]  # [N, 1]: < total, as u < 1
    block = torch.searchsorted(cdf, x, right=True).clamp_(max=nb - 1)  # [N, 1] first block whose cdf > x
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(x))  # [N, 1]
    idx = block * BLOCK + torch.arange(BLOCK)  # [N, B] token ids of the block
    inside = probs.gather(1, idx.clamp(max=V - 1)).to(torch.float64)  # [N, B]
    inside.masked_fill_(idx >= V, 0.0).cumsum_(-1)
    # x - before >= 0 exactly (before <= x); stay below the block's own total, which may differ from
    # its block sum in the last bits (another summation order): the draw then lands on its last
    # token of positive probability, never past it
    rest = torch.minimum(x - before, inside[:, -1:] * (1 - 2**-40))  # [N, 1]
    pos = torch.searchsorted(inside, rest, right=True)  # [N, 1]
    return (block * BLOCK + pos)[:, 0].tolist()
