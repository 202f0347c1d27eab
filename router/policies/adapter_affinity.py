"""adapter_affinity: send a LoRA request to a worker that already holds its adapter, unless that
worker is overloaded; else to the least-loaded worker, which loads the adapter on first use
(after Ray Serve LLM's and llm-d's adapter-aware picking). Wraps the configured policy, so a
holder is still chosen by it (prefix_aware's prefix hits, least_loaded's balance).

Rule, per request with adapter A (load = WorkerState.load_tokens; holders = healthy workers whose
latest LoadReport lists A in ``adapters``; least = the least-loaded healthy worker):

    a holder h is overloaded when  load(h) - load(least) > balance_abs_tokens
                              and  load(h) > balance_rel * load(least)
    usable = the holders that are not overloaded
    usable non-empty   -> the inner policy chooses among ``usable`` only          (adapter hit)
    holders, none usable -> least (logged, counted: it loads A; A then spreads)  (overload fallback)
    no holder          -> least (it loads A on first use)                        (cold)

Only workers that serve adapters (LoadReport.max_loaded_adapters > 0) are candidates; the pipeline
refuses an adapter request whose model has none (FAILED_PRECONDITION).

A request without an adapter goes to the inner policy untouched. The thresholds are
prefix_aware's (4096 tokens and 1.5x by default) for the same reason: loading an adapter costs
about one prefill of its weights, not worth it for a small imbalance, but a popular adapter must
not pin all its traffic to the one worker that loaded it first.

Example: w0 holds "sql" with load 900, w1 holds nothing with load 100 -> a "sql" request goes to
w0 (900 - 100 <= 4096); once w0's load is 6000 and w1's 1000, the next one goes to w1, which
loads "sql" and from its next report on is a holder too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

from router.policies.base import (NoWorkersAvailable, PolicyConfigError, RouteRequest, RoutingPolicy, WorkerState,
                                  healthy_workers, log_fallback)
from router.policies.least_loaded import least_loaded

logger = logging.getLogger(__name__)


class AdapterAffinityPolicy:
    name: ClassVar[str] = "adapter_affinity"

    def __init__(self, inner: RoutingPolicy, *, balance_abs_tokens: int = 4096, balance_rel: float = 1.5) -> None:
        if not isinstance(balance_abs_tokens, int) or balance_abs_tokens < 0:
            raise PolicyConfigError(f"adapter_affinity.balance_abs_tokens={balance_abs_tokens!r}: must be an "
                                    "integer >= 0")
        if not isinstance(balance_rel, (int, float)) or not balance_rel >= 1.0:
            raise PolicyConfigError(f"adapter_affinity.balance_rel={balance_rel!r}: must be a number >= 1.0")
        self.inner = inner
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = float(balance_rel)
        self.counts = {"adapter_hits": 0, "adapter_cold": 0, "adapter_overload_fallbacks": 0}

    def select(self, request: RouteRequest, workers: Sequence[WorkerState]) -> str:
        if not request.adapter:
            return self.inner.select(request, workers)
        healthy = [w for w in healthy_workers(workers) if w.max_loaded_adapters > 0]
        if not healthy:  # the pipeline refuses such a request first (FAILED_PRECONDITION)
            raise NoWorkersAvailable(f"request {request.request_id}: no healthy worker serves LoRA adapters")
        least = least_loaded(healthy)
        holders = [w for w in healthy if request.adapter in w.adapters]
        usable = {w.worker_id for w in holders if not self._overloaded(w, least)}
        if usable:
            self.counts["adapter_hits"] += 1
        elif holders:
            self.counts["adapter_overload_fallbacks"] += 1
            log_fallback(logger, self.counts["adapter_overload_fallbacks"],
                         "request %s: every worker holding adapter %s is overloaded (least load %d on %s, beyond "
                         "+%d tokens and x%.2f); routing to %s, which loads it", request.request_id, request.adapter,
                         min(w.load_tokens for w in holders), min(holders, key=lambda w: w.load_tokens).worker_id,
                         self.balance_abs_tokens, self.balance_rel, least.worker_id)
            usable = {least.worker_id}
        else:
            self.counts["adapter_cold"] += 1
            logger.debug("request %s: no worker holds adapter %s; %s (least loaded) loads it", request.request_id,
                         request.adapter, least.worker_id)
            usable = {least.worker_id}
        # The inner policy chooses (and records its own state, e.g. prefix_aware's) among ``usable`` only.
        return self.inner.select(request, [w if w.worker_id in usable else replace(w, healthy=False)
                                           for w in workers])

    def _overloaded(self, w: WorkerState, least: WorkerState) -> bool:
        hi, lo = w.load_tokens, least.load_tokens
        return hi - lo > self.balance_abs_tokens and hi > self.balance_rel * lo

    def on_request_complete(self, worker_id: str, request_id: str) -> None:
        self.inner.on_request_complete(worker_id, request_id)

    def counters(self) -> dict[str, int]:
        return {**self.inner.counters(), **self.counts}
