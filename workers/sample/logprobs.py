"""Logprobs of generated tokens: the chosen token's log-probability and the k most likely others.

Which distribution: the one the token was drawn from, after penalties, logit_bias, the min_tokens
mask and temperature (greedy requests: temperature 1), before min_p / top_k / top_p truncation;
``log_softmax`` of those logits. This is vLLM's ``logprobs_mode="processed_logprobs"`` (vLLM's
default, ``raw_logprobs``, is taken before penalties and temperature; without penalties, bias and
min_tokens at temperature 1 the two agree). Tokens the min_tokens mask bans have logprob -inf.

Worked example: logits [2, 1, 0] at temperature 1 -> log_softmax [-0.41, -1.41, -2.41]; token 1
drawn with k=2 -> TokenLogprob(1, -1.41, ((0, -0.41), (1, -1.41))).

Axes: N rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the top alternatives at its position (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logprobs [N, V] (log_softmax rows), the token chosen on each row and each row's k -> one
    TokenLogprob per row. One topk call over the batch (the largest k), cut per row."""
    assert logprobs.shape[0] == len(token_ids) == len(ks)
    if not token_ids:
        return []
    logprobs = logprobs.float()
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])[:, 0].tolist()  # [N]
    k_max = max(ks)
    top_vals: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if k_max:
        vals, ids = torch.topk(logprobs, k_max, dim=-1)  # [N, K]
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for i, (t, k) in enumerate(zip(token_ids, ks)):  # ties inside the top k: lower id first
        pairs = sorted(zip(top_ids[i][:k], top_vals[i][:k]), key=lambda p: (-p[1], p[0]))
        out.append(TokenLogprob(t, chosen[i], tuple(pairs)))
    return out
