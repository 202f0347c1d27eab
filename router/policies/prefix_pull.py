"""PrefixPullPlanner: when the chosen worker lacks a long prompt prefix that another worker holds,
name that worker in the Submit (``prefix_source``) so the chosen one pulls the KV blocks instead of
recomputing them (the worker side: workers/handoff/prefix_pull.py).

The planner keeps its own PrefixTree (router/prefix_tree.py) of what was sent where, whatever the
routing policy, so the pull works under round_robin and least_loaded as well as prefix_aware (whose
imbalance fallback is exactly the case it helps: a hot prefix overflowing to an idle worker).

With ``holdings`` (router/prefix_index.py, what the workers report: their prefix caches and lower
KV tiers, host memory and disk), matched(w) is the larger of what the tree says and what w reports
holding in any tier: a holder's tiers keep a prefix long after the tree, capped at the device
cache's size, forgot it, and the holder serves a pull from them (workers/handoff/prefix_pull.py).

Rule, per colocated route (P = the prompt, matched(w) = leading blocks of P sent to worker w, or
reported by it):
    holder = the healthy worker other than the chosen one with the most matched blocks (ties:
             lower load, then id)
    n      = min(matched(holder), (len(P) - 1) // block_size) blocks (the last prompt token is
             always computed on the chosen worker)
    pull   when n * block_size >= min_tokens and n > matched(chosen)
Then P's blocks are recorded under the chosen worker (it will hold them). A worker that leaves or
restarts (new incarnation) is forgotten. The tree is approximate (a holder may have evicted the
prefix since): a wrong guess costs one failed pull and the recompute the request would have done
anyway, counted by the workers (LoadReport.prefix_pull_failures).

Example (block_size 16, min_tokens 1024): w0 served a 2,000-token document + question; the policy
sends the next question on that document to w1 (w0 is busy): the Submit to w1 carries
prefix_source = (w0, 1984 tokens), and w1 computes only the last 16 + question tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import PolicyConfigError, RouteRequest, WorkerState
from router.prefix_index import PrefixIndex
from router.prefix_tree import PrefixTree, block_hashes

MAX_BLOCKS_PER_WORKER = 4096  # before a worker reports its KV capacity


@dataclass(frozen=True)
class PullSource:
    """Where the chosen worker pulls the first ``num_tokens`` prompt tokens' KV from."""

    worker_id: str
    endpoint: str
    incarnation: str
    num_tokens: int


class PrefixPullPlanner:
    def __init__(self, min_tokens: int, block_size: int, holdings: PrefixIndex | None = None) -> None:
        """holdings: the workers' reported holdings (every tier), None to go by the tree alone."""
        if not isinstance(min_tokens, int) or min_tokens < 1:
            raise PolicyConfigError(f"prefix_pull_min_tokens={min_tokens!r}: must be an integer >= 1 to plan pulls")
        if not isinstance(block_size, int) or block_size < 1:
            raise PolicyConfigError(f"prefix pull block_size={block_size!r}: must be an integer >= 1")
        self.min_tokens = min_tokens
        self.block_size = block_size
        self.tree = PrefixTree()
        self.holdings = holdings
        self._incarnations: dict[str, str] = {}
        self.counts = {"prefix_pulls_planned": 0, "prefix_pull_tokens_planned": 0}

    def plan(self, request: RouteRequest, chosen_id: str, workers: Sequence[WorkerState]) -> PullSource | None:
        """The pull for a request routed (colocated) to ``chosen_id``, or None; records the route."""
        self._sync(workers)
        hashes = block_hashes(request.prompt_token_ids, self.block_size, request.prefix_root)
        matched = self.tree.match(hashes)
        for wid, n in self._reported(request, workers).items():
            matched[wid] = max(matched.get(wid, 0), n)
        chosen = next((w for w in workers if w.worker_id == chosen_id), None)
        source = None
        holders = [w for w in workers if w.healthy and w.worker_id != chosen_id and matched.get(w.worker_id, 0)
                   and w.endpoint and w.incarnation]
        if holders and chosen is not None:
            holder = min(holders, key=lambda w: (-matched[w.worker_id], w.load_tokens, w.worker_id))
            n = min(matched[holder.worker_id], (len(request.prompt_token_ids) - 1) // self.block_size)
            if n * self.block_size >= self.min_tokens and n > matched.get(chosen_id, 0):
                source = PullSource(holder.worker_id, holder.endpoint, holder.incarnation, n * self.block_size)
                self.counts["prefix_pulls_planned"] += 1
                self.counts["prefix_pull_tokens_planned"] += source.num_tokens
        if chosen is not None:
            self.tree.insert(chosen_id, hashes, self._max_blocks(chosen))
        return source

    def _reported(self, request: RouteRequest, workers: Sequence[WorkerState]) -> dict[str, int]:
        """Leading blocks (of ``block_size`` tokens) of the prompt each worker reports holding, in any tier."""
        h = self.holdings
        if h is None:
            return {}
        ids = [w.worker_id for w in workers if h.knows(w.worker_id)]
        return {wid: n * h.block_size(wid) // self.block_size
                for wid, n in h.match(request.prompt_token_ids, ids, request.prefix_root).items()}

    def _max_blocks(self, w: WorkerState) -> int:
        if w.kv_blocks_total and w.kv_block_size:
            return max(1, w.kv_blocks_total * w.kv_block_size // self.block_size)
        return MAX_BLOCKS_PER_WORKER

    def _sync(self, workers: Sequence[WorkerState]) -> None:
        """Forget workers that left the membership or restarted (their caches are empty)."""
        present = {w.worker_id: w for w in workers}
        for wid in self.tree.workers:
            w = present.get(wid)
            if w is None or (w.incarnation and self._incarnations.get(wid, w.incarnation) != w.incarnation):
                self.tree.remove_worker(wid)
        self._incarnations = {wid: w.incarnation for wid, w in present.items() if w.incarnation}

    def counters(self) -> dict[str, int]:
        return dict(self.counts)
