"""Sampler: logits of the rows that need a next token -> token ids (and logprobs when asked).

Per row: mask the tokens a structured-output request's grammar does not allow (-inf; the mask
comes from workers/sample/grammar_masks.py, one bool [N, V] for the batch, all True on free rows),
process the logits (penalties, logit_bias, min_tokens: workers/sample/penalties.py).
Greedy rows (temperature 0) take the argmax. Other rows: divide by temperature, drop tokens below
min_p x the top probability, keep the top_k largest logits (if top_k > 0), keep the smallest set
of tokens whose probability mass reaches top_p (always at least the most likely), renormalise and
draw with the request's own generator (workers/sample/draw.py: one uniform per row, inverse CDF).
A request with a seed owns a generator seeded with it, so its draws do not depend on what else is
in the batch. Logprobs (workers/sample/logprobs.py) are log_softmax of the temperature-scaled
processed logits (temperature 1 for greedy rows).

Work a row does not ask for is skipped: no copy or processing pass when no row has penalties,
bias, min_tokens or logprobs; min_p / top_k / top_p passes only when some row sets them; the
argmax only over greedy rows. Every step is a tensor op over the batch; the only loop over rows
draws one uniform per seeded request from its generator.

Axes: N rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.sample.draw import draw
from workers.sample.logprobs import TokenLogprob, gather_logprobs
from workers.sample.penalties import RowContext, process_logits
from workers.sampling_params import SamplingParams
from workers.structured.matcher import apply_masks


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already temperature-scaled) -> logits with filtered entries at -inf."""
    return apply_filters(logits[None], [top_k], [top_p], [0.0])[0]


def apply_filters(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """logits [N, V] (temperature-scaled) -> logits with the entries that min_p, top_k and top_p
    drop set to -inf (that order, as vLLM applies them). Per-row settings; 0 / 1.0 / 0 = off. Each
    pass touches only the rows that set its filter, so a row's result never depends on the batch
    (a top_p of 1.0 computed in float32 could otherwise drop a tail token whose cumulative mass
    rounds to 1)."""
    n, V = logits.shape
    dev = logits.device
    rows = [i for i in range(n) if min_p[i]]
    if rows:
        index, sub = _rows(logits, rows)
        probs = sub.softmax(-1)  # [R, V]
        floor = torch.tensor([min_p[i] for i in rows], dtype=probs.dtype, device=dev)[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.index_copy(0, index, sub.masked_fill(probs < floor, float("-inf")))
    rows = [i for i in range(n) if 0 < top_k[i] < V]
    if rows:
        index, sub = _rows(logits, rows)
        k = torch.tensor([top_k[i] for i in rows], device=dev)  # [R]
        kth = torch.sort(sub, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [R, 1]
        logits = logits.index_copy(0, index, sub.masked_fill(sub < kth, float("-inf")))
    rows = [i for i in range(n) if top_p[i] < 1.0]
    if rows:
        index, sub = _rows(logits, rows)
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # mass strictly before each token; a token is kept while that mass is < top_p
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= torch.tensor([top_p[i] for i in rows], dtype=probs.dtype, device=dev)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.index_copy(0, index, sub.masked_fill(drop, float("-inf")))
    return logits


def _rows(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [R], logits[index] [R, V]) of the given rows."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return index, logits.index_select(0, index)


def temperatures(params: Sequence[SamplingParams], like: torch.Tensor) -> torch.Tensor:
    """[N, 1]: each row's temperature, 1 for greedy rows (their logprobs use the unscaled logits)."""
    return torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=like.dtype,
                        device=like.device)[:, None]


def scaled(processed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """processed [N, V] / each row's temperature (the input itself when every one is 1: x / 1 == x)."""
    if all(p.greedy or p.temperature == 1.0 for p in params):
        return processed
    return processed / temperatures(params, processed)


def sampling_weights(processed: torch.Tensor, params: Sequence[SamplingParams], *, consume: bool = False) -> torch.Tensor:
    """processed logits [N, V] -> what each (non-greedy) row draws in proportion to: exp(filtered
    scaled logits - the row's max) [N, V], unnormalised (the draw divides by the row's sum itself,
    so the softmax's own normalising pass is not needed). consume: ``processed`` is a private
    copy no one reads afterwards, so it is overwritten instead of a new [N, V] tensor being
    allocated and filled (the same values either way)."""
    filtered = apply_filters(scaled(processed, params), [p.top_k for p in params], [p.top_p for p in params],
                             [p.min_p for p in params])
    if consume or filtered is not processed:  # a tensor of our own: in place
        return filtered.sub_(filtered.amax(-1, keepdim=True)).exp_()
    return (filtered - filtered.amax(-1, keepdim=True)).exp_()


def sampling_probs(processed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """processed logits [N, V] -> the distribution each (non-greedy) row draws from [N, V]."""
    w = sampling_weights(processed, params)
    return w / w.sum(-1, keepdim=True)


def logprobs_of(processed: torch.Tensor, params: Sequence[SamplingParams], tokens: list[int]) -> list[TokenLogprob]:
    """processed logits [N, V] and the token chosen on each row -> their TokenLogprobs."""
    lp = torch.log_softmax(scaled(processed, params), dim=-1)  # [N, V]
    return gather_logprobs(lp, tokens, [p.top_logprobs or 0 for p in params])


class Sampler:
    """eos_token_ids: the model's end-of-sequence ids (min_tokens masks them)."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def process(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
        """logits [N, V] -> processed float32 logits on the CPU [N, V] (request generators live on
        the CPU: seeded draws must not depend on the device)."""
        return process_logits(logits.float().cpu(), rows, self.eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V]
        rows: Sequence[RowContext],
        generators: Sequence[torch.Generator],
        allowed: torch.Tensor | None = None,  # [N, V] bool: structured-output masks; None = no row constrained
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """-> (a token per row, its TokenLogprob or None where the row's request asked for none)."""
        params = [r.params for r in rows]
        plain = not any(p.processes_logits or p.top_logprobs is not None for p in params)
        if allowed is not None and not (plain and all(p.greedy for p in params)):
            logits = logits.float().cpu()  # the CPU path below: mask there (no host -> device copy of it)
        logits = apply_masks(logits, allowed)  # first, so penalties, bias and logprobs all see it
        if plain and all(p.greedy for p in params):
            return logits.argmax(-1).tolist(), [None] * len(rows)  # on the logits' device, no copy
        processed = self.process(logits, rows)  # [N, V]
        tokens = [0] * len(rows)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            picked = processed.argmax(-1) if not sampled else processed[greedy].argmax(-1)  # [G]
            for i, t in zip(greedy, picked.tolist()):
                tokens[i] = t
        want = [i for i, p in enumerate(params) if p.top_logprobs is not None]
        if sampled:
            rows_s = processed if not greedy else processed[sampled]  # [S, V]
            # overwritable when it is no caller's tensor (a row subset, or the fp32 copy of bf16
            # logits) and no logprobs are read from it below
            private = rows_s is not logits and not (want and rows_s is processed)
            weights = sampling_weights(rows_s, [params[i] for i in sampled], consume=private)  # [S, V]
            for i, t in zip(sampled, draw(weights, [generators[i] for i in sampled])):
                tokens[i] = t
        out: list[TokenLogprob | None] = [None] * len(rows)
        if want:
            for i, lp in zip(want, logprobs_of(processed[want], [params[i] for i in want], [tokens[i] for i in want])):
                out[i] = lp
        return tokens, out
