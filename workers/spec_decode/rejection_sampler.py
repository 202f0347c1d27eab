"""Verification of draft tokens: keep the longest correct prefix, then one token of the target's.

Terms (per request, k draft tokens x_1..x_k proposed after the request's last token):
    p_i   the target's distribution at draft position i (i = 1..k+1), after temperature / top-k /
          top-p, from one forward pass over [last token, x_1..x_k] (rows 0..k of ``target_logits``).
    q_i   the distribution the proposer drew x_i from; a deterministic proposer (prompt lookup, a
          greedy drafter) has q_i = one-hot(x_i).

Greedy (temperature 0): accept x_i while x_i == argmax p_i; the first mismatch is replaced by
argmax p_i and verification stops; if all k match, argmax p_{k+1} is the bonus token. So the output
is exactly plain greedy decoding's, k+1 tokens at a time at best.

Sampling (Leviathan et al. 2023, Chen et al. 2023; gpt-fast's acceptance rule): accept x_i with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the replacement from the
residual norm(max(0, p_i - q_i)) and stop; after k acceptances draw a bonus token from p_{k+1}.
Each emitted token is then distributed exactly as p (lossless): P(emit x) = q(x) min(1, p(x)/q(x))
+ (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q)(x) +
max(0, p - q)(x) = p(x). Every draw uses the request's own generator, so seeded runs reproduce.

Worked example (greedy): drafts [5, 9, 2], target argmax per row [5, 9, 7, 4] -> [5, 9, 7]
(two drafts accepted, 7 replaces the rejected 2; the bonus 4 is not reached).

Axes: K draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from workers.layers.sampler import apply_top_k_top_p
from workers.sampling_params import SamplingParams


def accept_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax: argmax of rows 0..k (k + 1 ids); draft: k ids -> the tokens to emit (1..k+1)."""
    assert len(target_argmax) == len(draft) + 1
    out: list[int] = []
    for want, got in zip(target_argmax, draft):
        out.append(want)
        if want != got:
            return out
    out.append(target_argmax[-1])
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> the sampling distribution of each row [R, V] (float32, CPU), exactly the one
    ``workers.layers.sampler.Sampler`` draws from."""
    logits = logits.float().cpu() / params.temperature
    return torch.stack([apply_top_k_top_p(row, params.top_k, params.top_p).softmax(-1) for row in logits])


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """p [K+1, V] target distributions; draft K ids; q [K, V] draft distributions (None = each draft
    was deterministic, q_i = one-hot(x_i)) -> the tokens to emit (1..K+1)."""
    k = len(draft)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k)
    if q is not None and q.shape[1] < p.shape[1]:  # a drafter with a smaller (unpadded) vocabulary
        q = torch.nn.functional.pad(q, (0, p.shape[1] - q.shape[1]))
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        assert qx > 0.0, "a draft token must have positive draft probability"
        u = float(torch.rand(1, generator=generator))
        if u < px / qx:  # accept with probability min(1, p/q)
            out.append(x)
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - q[i].to(p.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is empty, p is exact
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out
