"""Verification of draft tokens: keep the longest correct prefix, then one token of the target's.

Terms (per request, k draft tokens x_1..x_k proposed after the request's last token):
    p_i   the target's distribution at draft position i (i = 1..k+1), after the structured-output
          mask (the grammar advanced through x_1..x_{i-1}; so a draft the grammar rejects has
          p_i(x_i) = 0 and is never accepted), penalties / logit bias /
          min_tokens (with x_1..x_{i-1} counted as generated, exactly the history plain decoding
          would have at that position), temperature, min-p / top-k / top-p, from one forward pass
          over [last token, x_1..x_k] (rows 0..k of ``target_logits``).
    q_i   the distribution the proposer drew x_i from; a deterministic proposer (prompt lookup, a
          greedy drafter) has q_i = one-hot(x_i).

Greedy (temperature 0): accept x_i while x_i == argmax p_i (of the processed logits); the first mismatch is replaced by
argmax p_i and verification stops; if all k match, argmax p_{k+1} is the bonus token. So the output
is exactly plain greedy decoding's, k+1 tokens at a time at best.

Sampling (Leviathan et al. 2023, Chen et al. 2023; gpt-fast's acceptance rule): accept x_i with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the replacement from the
residual norm(max(0, p_i - q_i)) and stop; after k acceptances draw a bonus token from p_{k+1}.
Each emitted token is then distributed exactly as p (lossless): P(emit x) = q(x) min(1, p(x)/q(x))
+ (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q)(x) +
max(0, p - q)(x) = p(x). Every draw uses the request's own generator, so seeded runs reproduce.

Logprobs of the emitted tokens are the target's (row i's log_softmax, as the plain sampler reports).

Worked example (greedy): drafts [5, 9, 2], target argmax per row [5, 9, 7, 4] -> [5, 9, 7]
(two drafts accepted, 7 replaces the rejected 2; the bonus 4 is not reached).

Axes: K draft tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from workers.sample.draw import draw
from workers.sample.logprobs import TokenLogprob
from workers.sample.penalties import RowContext
from workers.sample.sampler import Sampler, logprobs_of, sampling_probs
from workers.sampling_params import SamplingParams
from workers.structured.matcher import apply_masks


@dataclass(frozen=True)
class VerifySpan:
    """One request's verify chunk: logits rows first_row..first_row + k, the request's context at
    the chunk's first position, its k drafts, their distributions q ([k, V]; None =
    deterministic), the request's generator and, for a structured-output request, the rows'
    masks ([k + 1, V] bool, row i = what the grammar allows after drafts 1..i)."""

    first_row: int
    context: RowContext
    draft: list[int]
    q: torch.Tensor | None
    generator: torch.Generator
    allowed: torch.Tensor | None = None
    request_id: str = ""


def verify_spans(sampler: Sampler, logits: torch.Tensor,
           spans: list[VerifySpan]) -> list[tuple[list[int], list[TokenLogprob] | None]]:
    """logits [N, V] -> per span, in order: the tokens to emit (1..k+1) and, when the request asked
    for them, their logprobs."""
    rows = [replace(s.context, drafts=tuple(s.draft[:j])) for s in spans for j in range(len(s.draft) + 1)]
    index = [s.first_row + j for s in spans for j in range(len(s.draft) + 1)]
    plain = all(r.params.greedy and not r.params.processes_logits and r.params.top_logprobs is None for r in rows)
    # [R, V]: every verify row, masked by its grammar (structured output) then processed per position
    # (plain greedy rows: argmax where they are)
    masked = apply_masks(logits[index], _stacked_masks(spans, logits.shape[1]))
    processed = masked if plain else sampler.process(masked, rows)
    argmax = processed.argmax(-1).tolist()
    out: list[tuple[list[int], list[TokenLogprob] | None]] = []
    row = 0
    for s in spans:
        k, params = len(s.draft), s.context.params
        if params.greedy:
            tokens = accept_greedy(argmax[row : row + k + 1], s.draft)
        else:
            p = sampling_probs(processed[row : row + k + 1], [params] * (k + 1))  # [k + 1, V]
            tokens = accept_sampled(p, s.draft, s.q, s.generator)
        lps = None
        if params.top_logprobs is not None:  # emitted token j was drawn at row j of the span
            lps = logprobs_of(processed[row : row + len(tokens)], [params] * len(tokens), tokens)
        out.append((tokens, lps))
        row += k + 1
    return out


def _stacked_masks(spans: list[VerifySpan], vocab_size: int) -> torch.Tensor | None:
    """The spans' masks as one bool [R, V] (all True for unconstrained spans); None if none has one."""
    if all(s.allowed is None for s in spans):
        return None
    return torch.cat([s.allowed if s.allowed is not None else torch.ones(len(s.draft) + 1, vocab_size, dtype=torch.bool)
                      for s in spans])


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
    """logits [R, V] (already processed: penalties are the caller's) -> the sampling distribution
    of each row [R, V] (float32, CPU), exactly the one ``workers.sample.sampler.Sampler`` draws from."""
    return sampling_probs(logits.float().cpu(), [params] * logits.shape[0])


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
        out.append(draw(residual[None], [generator])[0])
        return out
    out.append(draw(p[k : k + 1], [generator])[0])
    return out
