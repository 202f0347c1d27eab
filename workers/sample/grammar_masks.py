"""A step's structured-output masks: which tokens each sampled row may take (the runner's side).

For the plain rows of a step (one token each) ``plain_masks`` syncs each constrained request's
matcher with its tokens and stacks the masks into one bool [N, V] tensor (free rows all True), so
the sampler masks constrained and free requests in one batched op. For a verify chunk
(speculative decoding) ``verify_masks`` gives the k + 1 rows' masks (workers/structured/matcher.py).

In the engine the plain rows' masks come from a ``MaskWorker``: computed on a background thread,
all rows at once, while the step's forward pass runs (``plain_masks`` is the same computation
inline, one row after another; tests check they agree).

A row whose mask leaves no token that may be sampled there is a dead end: the grammar admits no
token (or only EOS / stop ids while min_tokens still forbids them). The request then ends with a
GrammarError naming the field, instead of sampling from an empty distribution. In a verify chunk
a dead row after some drafts only shortens the drafts verified (plain decoding would have
emitted those drafts first and hit the dead end on a later step; so does the shortened chunk).

Axes: N rows, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from workers.sample.penalties import RowContext, stop_ids
from workers.structured.matcher import GrammarError, GrammarMatcher, unpack_bitmask


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


class MaskWorker:
    """Computes the plain rows' masks of a step on a background thread while the forward pass runs
    (llguidance releases the GIL and fills all rows in parallel on its own threads), so the masks
    cost the step little more than the join. ``start`` before the forward pass, ``result`` after.
    Each matcher is touched only by the job until it is joined (a request is in one row a step)."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], threads: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance.LLExecutor, made on first use

    def start(self, jobs: dict[str, tuple[RowContext, GrammarMatcher]]) -> Future | None:
        """Start computing the masks of ``jobs`` (request id -> its row and matcher); None if empty.
        The future's result: request id -> bool [V] mask, or the GrammarError that ends it."""
        if not jobs:
            return None
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duet-masks")
            self._executor = llguidance.LLExecutor(self._threads)
        return self._pool.submit(self._compute, jobs)

    def _compute(self, jobs: dict[str, tuple[RowContext, GrammarMatcher]]) -> dict[str, np.ndarray | GrammarError]:
        out: dict[str, np.ndarray | GrammarError] = {}
        live: list[tuple[str, GrammarMatcher]] = []
        for rid, (row, m) in jobs.items():
            try:
                m.sync(row.token_ids, row.output_start)
                m.check_error()
            except GrammarError as e:
                out[rid] = e
            else:
                live.append((rid, m))
        if not live:
            return out
        words = np.full((len(live), (self.vocab_size + 31) // 32), -1, dtype=np.int32)  # [R, W]
        self._executor.unsafe_compute_mask_ptr([(m.llmatcher(), i) for i, (_, m) in enumerate(live)],
                                               words.ctypes.data, words.shape[1] * 4, len(live))
        allowed = unpack_bitmask(words, self.vocab_size)  # [R, V]
        for i, (rid, m) in enumerate(live):
            banned = _banned(jobs[rid][0], self.eos_token_ids)
            try:
                m.check_error()
            except GrammarError as e:
                out[rid] = e
                continue
            out[rid] = allowed[i] if _alive(allowed[i], banned) else _dead_end(m, banned)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def gather_masks(ids: Sequence[str], results: dict[str, np.ndarray | GrammarError],
                 vocab_size: int) -> tuple[torch.Tensor | None, dict[int, GrammarError]]:
    """A MaskWorker's results in row order (``ids``: each plain row's request id) -> (allowed bool
    [N, V] or None when no row is constrained, errors by row index), as ``plain_masks`` returns."""
    if not any(r in results for r in ids):
        return None, {}
    allowed = np.ones((len(ids), vocab_size), dtype=bool)  # [N, V]
    errors: dict[int, GrammarError] = {}
    for i, rid in enumerate(ids):
        r = results.get(rid)
        if isinstance(r, GrammarError):
            errors[i] = r
        elif r is not None:
            allowed[i] = r
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
