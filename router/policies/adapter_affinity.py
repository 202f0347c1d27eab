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

The rule itself is ``adapter_pick``, which router/policies/disagg.py applies to the prefill side
of a disaggregated request as well (a prefill worker computes the prompt's KV under the adapter,
so it loads the adapter too).

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
from dataclasses import dataclass, replace
from typing import ClassVar

from router.policies.base import (NoWorkersAvailable, PolicyConfigError, RouteRequest, RoutingPolicy, WorkerState,
                                  healthy_workers, log_fallback)
from router.policies.least_loaded import least_loaded

logger = logging.getLogger(__name__)

HIT, COLD, OVERLOADED = "hit", "cold", "overloaded"
BALANCE_ABS_TOKENS, BALANCE_REL = 4096, 1.5  # the defaults (prefix_aware's): module docstring


@dataclass(frozen=True)
class AdapterPick:
    """The rule's outcome: the workers a request for the adapter may go to, and why (HIT: holders
    that are not overloaded; COLD: nobody holds it; OVERLOADED: every holder is -- both: the least
    loaded worker, which loads it). ``holders``: every healthy holder."""

    usable: tuple[str, ...]
    outcome: str
    holders: tuple[WorkerState, ...] = ()


def adapter_pick(adapter: str, candidates: Sequence[WorkerState], *, balance_abs_tokens: int,
                 balance_rel: float) -> AdapterPick:
    """The module docstring's rule over ``candidates`` (healthy workers that serve adapters; not empty)."""
    assert candidates, "adapter_pick needs at least one candidate"
    least = least_loaded(candidates)
    holders = tuple(w for w in candidates if adapter in w.adapters)

    def overloaded(w: WorkerState) -> bool:
        hi, lo = w.load_tokens, least.load_tokens
        return hi - lo > balance_abs_tokens and hi > balance_rel * lo

    usable = tuple(w.worker_id for w in holders if not overloaded(w))
    if usable:
        return AdapterPick(usable, HIT, holders)
    return AdapterPick((least.worker_id,), OVERLOADED if holders else COLD, holders)


class AdapterAffinityPolicy:
    name: ClassVar[str] = "adapter_affinity"

    def __init__(self, inner: RoutingPolicy, *, balance_abs_tokens: int = BALANCE_ABS_TOKENS,
                 balance_rel: float = BALANCE_REL) -> None:
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
        pick = adapter_pick(request.adapter, healthy, balance_abs_tokens=self.balance_abs_tokens,
                            balance_rel=self.balance_rel)
        self.counts[_COUNTER[pick.outcome]] += 1
        if pick.outcome == OVERLOADED:
            log_overload(self.counts["adapter_overload_fallbacks"], request, pick, self.balance_abs_tokens,
                         self.balance_rel)
        elif pick.outcome == COLD:
            logger.debug("request %s: no worker holds adapter %s; %s (least loaded) loads it", request.request_id,
                         request.adapter, pick.usable[0])
        # The inner policy chooses (and records its own state, e.g. prefix_aware's) among ``usable`` only.
        usable = set(pick.usable)
        return self.inner.select(request, [w if w.worker_id in usable else replace(w, healthy=False)
                                           for w in workers])

    def on_request_complete(self, worker_id: str, request_id: str) -> None:
        self.inner.on_request_complete(worker_id, request_id)

    def counters(self) -> dict[str, int]:
        return {**self.inner.counters(), **self.counts}


_COUNTER = {HIT: "adapter_hits", COLD: "adapter_cold", OVERLOADED: "adapter_overload_fallbacks"}


def log_overload(count: int, request: RouteRequest, pick: AdapterPick, balance_abs_tokens: int, balance_rel: float,
                 side: str = "") -> None:
    """The overload fallback's warning (rate-limited by ``log_fallback``)."""
    busiest = min(pick.holders, key=lambda w: w.load_tokens)
    log_fallback(logger, count, "request %s: every %sworker holding adapter %s is overloaded (least load %d on %s, "
                 "beyond +%d tokens and x%.2f); routing to %s, which loads it", request.request_id, side,
                 request.adapter, busiest.load_tokens, busiest.worker_id, balance_abs_tokens, balance_rel,
                 pick.usable[0])
