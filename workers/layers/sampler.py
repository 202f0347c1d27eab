"""Sampler: logits of the rows that need a next token -> token ids.

Greedy rows (temperature 0) take the argmax. Other rows: divide by temperature, keep the top_k
largest logits (if top_k > 0), keep the smallest set of tokens whose probability mass reaches top_p
(always at least the most likely), renormalise and draw with the request's own generator. A
request with a seed owns a generator seeded with it, so its draws do not depend on what else is
in the batch.

Axes: N rows, V vocabulary.
"""

from __future__ import annotations

import torch

from workers.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already temperature-scaled) -> logits with filtered entries at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # mass strictly before each token; a token is kept while that mass is < top_p
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [N, V]
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[int]:
        greedy = logits.argmax(-1).tolist()  # [N]
        if all(p.greedy for p in params):
            return greedy
        # Request generators live on the CPU (seeded draws must not depend on the device).
        logits = logits.float().cpu()
        out: list[int] = []
        for i, p in enumerate(params):
            if p.greedy:
                out.append(greedy[i])
                continue
            row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
        return out
