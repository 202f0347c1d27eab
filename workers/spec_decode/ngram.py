"""Prompt-lookup proposer (n-gram matching over the request's own tokens; no model).

For each request, take its last n tokens (n from ngram_max down to ngram_min), find their most
recent earlier occurrence in the prompt + output, and propose the tokens that followed it. Code
edits, summaries, extraction and chat turns that quote the prompt repeat long spans, and then whole
runs of drafts are accepted at the cost of one target pass (Saxena 2023, "prompt lookup decoding").
Where nothing repeats, it proposes nothing and the request decodes plainly (no slowdown).

Worked example: tokens [7 1 2 3 4 9 1 2], ngram_max=2, asked for 3 -> the last 2-gram "1 2" last
occurred at position 1, followed by [3 4 9] -> draft [3 4 9].

Drafts are deterministic (q = one-hot), so the same prompt and seed give the same output.
The search scans back over at most ``max_scan`` of the newest tokens
(a bound on the cost per step however long the context grows).
"""

from __future__ import annotations

import time

from workers.engine.proposer import Draft, DraftAsk, DrafterRef, ProposerStats
from workers.sampling_params import SamplingParams


def lookup(tokens: list[int], k: int, ngram_min: int, ngram_max: int, max_scan: int = 4096) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (ngram_max >= n >= ngram_min); [] if none occurs."""
    n_tok = len(tokens)
    lo = max(0, n_tok - max_scan)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        suffix = tokens[n_tok - n :]
        first = suffix[0]
        # candidate starts s < n_tok - n, newest first, with tokens[s : s + n] == suffix
        for s in range(n_tok - n - 1, lo - 1, -1):
            if tokens[s] == first and tokens[s : s + n] == suffix:
                follow = tokens[s + n : s + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        assert 1 <= ngram_min <= ngram_max
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._stats = ProposerStats()

    def propose(self, asks: list[DraftAsk]) -> dict[str, Draft]:
        t0 = time.perf_counter()
        out = {}
        for a in asks:
            draft = lookup(a.token_ids, a.num_tokens, self.ngram_min, self.ngram_max)
            if draft:
                out[a.request_id] = Draft(draft)
        self._stats.calls += 1
        self._stats.seconds += time.perf_counter() - t0
        return out

    def prefetch(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 drafter: DrafterRef | None = None) -> None:
        pass  # stateless

    def release(self, request_id: str, *, handed_over: bool = False) -> None:
        pass

    def stats(self) -> ProposerStats:
        return self._stats

    def close(self) -> None:
        pass
