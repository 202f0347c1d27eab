"""Disaggregated routing: a request's route is a (prefill worker, decode worker) pair, or one
worker alone for prompts too short to be worth moving (after Dynamo's KV-aware router and
llm-d's / xLLM's per-request P/D decision).

Roles (the pool a worker belongs to, from the controller's membership): ``prefill`` workers only
ever compute prompts for others; ``decode`` and ``colocated`` workers take the request's stream.
With no prefill worker in the membership this is exactly the configured policy.

Algorithm, per request (P = prompt token ids, bs = block_size, load = WorkerState.load_tokens):
 1. decode = the configured policy (round_robin / least_loaded / prefix_aware) over the healthy
    decode and colocated workers. (prefix_aware here also steers a prompt to the decode worker
    that holds its prefix, which shrinks the KV transfer: only blocks beyond its hits are sent.)
 2. |P| < min_prompt_tokens, or no healthy prefill worker -> colocated on ``decode``
    (short prompts: the transfer and the extra hop cost more than the prefill they save). The
    second case is a fallback: logged and counted. A retry after the prefill half failed
    (``require_prefill``) runs colocated on ``decode`` (counted as ``retry_colocated``): it needs
    no other prefill worker and no second transfer. A lost node takes every prefill worker placed
    on it at once (PACK), the router learns that the others are gone only when their polls fail,
    and Ray needs a while to re-place them: a retry on "another" prefill worker would fail again
    or wait, and lose the request.
 3. prefill = argmin over healthy prefill workers of
        cost(p) = (ceil(|P| / bs) - matched_blocks(p))   prompt blocks p still has to compute
                + load(p) / bs                           work already queued on p, in blocks
    where matched_blocks(p) comes from a PrefixTree of prompts recently prefilled on p (as in
    prefix_aware). Ties: lower load, then id. The pair's total cost, Dynamo-style, is
    cost(prefill) + load(decode) / bs; the two terms depend on disjoint choices, so each half is
    minimised on its own.
 4. Record P's blocks under the chosen prefill worker.

A request with a LoRA adapter: its prompt's KV is computed under the adapter, so the prefill worker
loads the adapter too. Step 3 then runs over the prefill workers that serve adapters
(``max_loaded_adapters`` > 0), narrowed by the decode side's rule (router/policies/adapter_affinity.py
``adapter_pick``): the ones holding the adapter that are not overloaded, else the least-loaded one,
which loads it. With no healthy prefill worker serving adapters it runs colocated on ``decode``
(a fallback: logged and counted as ``prefill_no_adapter_fallbacks``).

Example (bs=16, min_prompt_tokens=256): a 40-token chat turn runs colocated on the least-loaded
decode worker; a 900-token document goes to the prefill worker that summarised the same document
before (57 blocks, 50 matched -> cost 7 + its load) unless another one is idle enough to win.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.policies.adapter_affinity import (
    BALANCE_ABS_TOKENS,
    BALANCE_REL,
    COLD,
    HIT,
    OVERLOADED,
    adapter_pick,
    log_overload,
)
from router.policies.base import (
    PolicyConfigError,
    RouteRequest,
    RoutingPolicy,
    WorkerState,
    log_fallback,
)
from router.prefix_tree import PrefixTree, block_hashes

if TYPE_CHECKING:
    from router.policies.prefix_pull import PullSource

logger = logging.getLogger(__name__)

PREFILL = "prefill"
MAX_TREE_BLOCKS_PER_WORKER = 4096


@dataclass(frozen=True)
class Route:
    """Where a request goes: ``decode_id`` streams it; ``prefill_id`` (None = colocated) computes its
    prompt; ``pull`` (colocated only) names a worker whose cached prompt prefix the decode worker
    pulls instead of recomputing (router/policies/prefix_pull.py)."""

    decode_id: str
    prefill_id: str | None = None
    pull: PullSource | None = None


@dataclass
class DisaggRouter:
    """Wraps the configured policy (which picks the decode side) with the prefill choice above."""

    decode_policy: RoutingPolicy
    block_size: int = 16
    min_prompt_tokens: int = 256
    tree: PrefixTree = field(default_factory=PrefixTree)
    counts: dict[str, int] = field(default_factory=lambda: {
        "disagg_routes": 0, "colocated_short": 0, "no_prefill_fallbacks": 0, "retry_colocated": 0,
        "prefill_adapter_hits": 0, "prefill_adapter_cold": 0, "prefill_adapter_overload_fallbacks": 0,
        "prefill_no_adapter_fallbacks": 0})
    adapter_balance_abs_tokens: int = BALANCE_ABS_TOKENS  # adapter_pick's thresholds on the prefill side
    adapter_balance_rel: float = BALANCE_REL

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise PolicyConfigError(f"disagg block_size={self.block_size!r}: must be an integer >= 1")
        if not isinstance(self.min_prompt_tokens, int) or self.min_prompt_tokens < 0:
            raise PolicyConfigError(f"disagg min_prompt_tokens={self.min_prompt_tokens!r}: must be an integer >= 0")

    def select(self, request: RouteRequest, workers: Sequence[WorkerState], *, require_prefill: bool = False) -> Route:
        decoders = [w for w in workers if w.role != PREFILL]
        decode_id = self.decode_policy.select(request, decoders)
        prefills = [w for w in workers if w.role == PREFILL]
        self._forget_departed(prefills)
        healthy = [w for w in prefills if w.healthy]
        if require_prefill:
            self.counts["retry_colocated"] += 1
            log_fallback(logger, self.counts["retry_colocated"], "request %s: its prefill worker failed; prefilling "
                         "on decode worker %s", request.request_id, decode_id)
            return Route(decode_id)
        if len(request.prompt_token_ids) < self.min_prompt_tokens:
            if prefills:
                self.counts["colocated_short"] += 1
            return Route(decode_id)
        if not healthy:
            if prefills:
                self.counts["no_prefill_fallbacks"] += 1
                log_fallback(logger, self.counts["no_prefill_fallbacks"], "request %s: no healthy prefill worker "
                             "(%d known); prefilling on decode worker %s", request.request_id, len(prefills), decode_id)
            return Route(decode_id)
        if request.adapter:
            healthy = self._adapter_prefills(request, healthy)
            if not healthy:
                self.counts["prefill_no_adapter_fallbacks"] += 1
                log_fallback(logger, self.counts["prefill_no_adapter_fallbacks"], "request %s: no healthy prefill "
                             "worker serves LoRA adapters (adapter %s); prefilling on decode worker %s",
                             request.request_id, request.adapter, decode_id)
                return Route(decode_id)
        hashes = block_hashes(request.prompt_token_ids, self.block_size, request.prefix_root)
        matched = self.tree.match(hashes)
        total = -(-len(request.prompt_token_ids) // self.block_size)
        best = min(healthy, key=lambda w: (total - matched.get(w.worker_id, 0) + w.load_tokens / self.block_size,
                                          w.load_tokens, w.worker_id))
        self.tree.insert(best.worker_id, hashes, MAX_TREE_BLOCKS_PER_WORKER)
        self.counts["disagg_routes"] += 1
        return Route(decode_id, best.worker_id)

    def _adapter_prefills(self, request: RouteRequest, healthy: Sequence[WorkerState]) -> list[WorkerState]:
        """The prefill workers an adapter request may use (module docstring); [] if none serves adapters."""
        candidates = [w for w in healthy if w.max_loaded_adapters > 0]
        if not candidates:
            return []
        pick = adapter_pick(request.adapter, candidates, balance_abs_tokens=self.adapter_balance_abs_tokens,
                            balance_rel=self.adapter_balance_rel)
        key = {HIT: "prefill_adapter_hits", COLD: "prefill_adapter_cold",
               OVERLOADED: "prefill_adapter_overload_fallbacks"}[pick.outcome]
        self.counts[key] += 1
        if pick.outcome == OVERLOADED:
            log_overload(self.counts[key], request, pick, self.adapter_balance_abs_tokens, self.adapter_balance_rel,
                         side="prefill ")
        usable = set(pick.usable)
        return [w for w in candidates if w.worker_id in usable]

    def on_request_complete(self, worker_id: str, request_id: str) -> None:
        self.decode_policy.on_request_complete(worker_id, request_id)

    def counters(self) -> dict[str, int]:
        return {**self.decode_policy.counters(), **self.counts}

    def _forget_departed(self, prefills: Sequence[WorkerState]) -> None:
        present = {w.worker_id for w in prefills}
        for wid in self.tree.workers:
            if wid not in present:
                self.tree.remove_worker(wid)
