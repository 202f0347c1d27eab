"""A step's structured-output masks: which tokens each sampled row may take (the runner's side).

For the plain rows of a step (one token each) ``plain_masks`` syncs each constrained request's
matcher with its tokens and stacks the masks into one bool [N, V] tensor (free rows all True), so
the sampler masks constrained and free requests in one batched op. For a verify chunk
(speculative decoding) ``verify_masks`` gives the k + 1 rows' masks (workers/structured/matcher.py).

A row whose mask leaves no token that may be sampled there is a dead end: the grammar admits no
token (or only EOS / stop ids while min_tokens still forbids them). The request then ends with a
GrammarError naming the field, instead of sampling from an empty distribution. In a verify chunk
a dead row after some drafts only shortens the drafts verified (plain decoding would have
emitted those drafts first and hit the dead end on a later step; so does the shortened chunk).

Axes: N rows, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.layers.penalties import RowContext, stop_ids
from workers.structured.matcher import GrammarError, GrammarMatcher


def _banned(row: RowContext, eos_token_ids: frozenset[int], extra_drafts: int = 0) -> list[int]:
    """Ids that min_tokens forbids at this row (after ``extra_drafts`` more drafts)."""
    if row.num_generated + len(row.drafts) + extra_drafts < row.params.min_tokens:
        return sorted(stop_ids(row.params, eos_token_ids))
    return []


def _alive(allowed: np.ndarray, banned: list[int]) -> bool:
    if not banned:
        return bool(allowed.any())
    keep = allowed.copy()
    keep[[t for t in banned if t < keep.shape[0]]] = False
    return bool(keep.any())


def _dead_end(matcher: GrammarMatcher, banned: list[int]) -> GrammarError:
    why = " (only EOS / stop ids, which min_tokens still forbids)" if banned else ""
    return GrammarError(matcher.field, f"the grammar admits no token after {matcher.num_consumed} generated "
                                       f"tokens{why}")


def plain_masks(rows: Sequence[RowContext], matchers: Sequence[GrammarMatcher | None], vocab_size: int,
                eos_token_ids: frozenset[int]) -> tuple[torch.Tensor | None, dict[int, GrammarError]]:
    """-> (allowed bool [N, V] or None when no row is constrained, errors by row index). A row in
    ``errors`` must not be sampled (its mask row is all True, a placeholder)."""
    if not any(m is not None for m in matchers):
        return None, {}
    allowed = np.ones((len(rows), vocab_size), dtype=bool)  # [N, V]
    errors: dict[int, GrammarError] = {}
    for i, (row, m) in enumerate(zip(rows, matchers)):
        if m is None:
            continue
        try:
            m.sync(row.token_ids, row.output_start)
            mask = m.mask(vocab_size)
        except GrammarError as e:
            errors[i] = e
            continue
        banned = _banned(row, eos_token_ids)
        if not _alive(mask, banned):
            errors[i] = _dead_end(m, banned)
            continue
        allowed[i] = mask
    return torch.from_numpy(allowed), errors


def verify_masks(row: RowContext, matcher: GrammarMatcher, drafts: list[int], vocab_size: int,
                 eos_token_ids: frozenset[int]) -> tuple[torch.Tensor, int]:
    """A verify chunk's masks: -> (allowed bool [k' + 1, V], k') where k' <= len(drafts) is how many
    drafts to verify (fewer when a later row is a dead end). GrammarError when row 0 is one."""
    matcher.sync(row.token_ids, row.output_start)
    masks = matcher.draft_masks(drafts, vocab_size)  # [K + 1, V]
    for j in range(len(masks)):
        banned = _banned(row, eos_token_ids, j)
        if not _alive(masks[j], banned):
            if j == 0:
                raise _dead_end(matcher, banned)
            keep = j - 1
            return torch.from_numpy(np.ascontiguousarray(masks[: keep + 1])), keep
    return torch.from_numpy(masks), len(drafts)
