"""Speculative decoding in the simulator: target pools drafting on M:N drafter pools, or on a private
drafter per target replica. This module holds the settings and counters; cluster/sim/drafting.py
the state while a simulation runs (which request drafts where).

Terms:
    SpecModel    a target pool's speculation: drafts per step ``k``, the per-request acceptance
                 (each request draws a from Beta with mean ``acceptance``), what verifying a draft
                 token costs the target step (``verify_token_cost``, per decode row), and where it
                 drafts: ``drafter_pool`` (M:N) or ``private`` (one drafter per target replica,
                 which batches only that replica's rows)
    DraftCost    a drafter's round: k forward passes over the rows it batches, each
                 ``base_s + per_row_s x rows``, plus ``link_s`` for a remote round; a drafter
                 replica holds at most ``max_rows`` requests (beyond: saturated)

The model, per target replica (cluster/sim/replica.py does the clock):
    rows         requests a drafter replica drafts for, from every target that sent them there: one
                 batched round serves them all (rounds from different targets are taken as
                 aligned, the drafter's continuous batching at its best)
    round        L = DraftCost.round_s(rows, k)
    wait         the step waits for the slowest of the drafter replicas its requests use. With
                 ``overlap`` the drafter drafts round t+1 while the target verifies round t; the
                 guess holds when every draft was accepted (probability ~ a^k at the mean a), and
                 then only max(0, L - verify step) is exposed:
                     wait = max over its drafters of  p L_hidden + (1 - p) L,  L_hidden = max(0, L - T_verify)
    tokens       a speculating request gains E = (1 - a^(k+1)) / (1 - a) tokens per step
    choice       a request speculates (on the least-loaded drafter replica with room, the real
                 router policy router/policies/drafter.py) only if it pays at join, counting what
                 it costs the whole batch: the added verify cost and the wait it adds (all of the
                 round when nothing drafts there yet) stall every sequence, so with T the step,
                 R the batch's tokens per step and dW the added wait
                     E - 1 - (R + 1) x (decode_per_seq_s x kappa k + dW) / T > 0.02
                 (the engine's rule, workers/engine/draft_length.py, charges a request only its
                 1/B share of the wait: right when the whole batch drafts, too little when one
                 request would make the batch wait alone); else, or with no drafter replica with
                 room (pool saturated or empty), it decodes plainly for its whole life (counted
                 in ``declined`` / ``fallbacks``)
    staleness    a target's wait is recomputed at its own events (a request joins or finishes
                 there): a change in a shared drafter's rows reaches the other targets at their
                 next event, not at once (each target has an event every few steps under load)

Cost: a drafter replica is a replica of its pool (its replica-seconds are counted like any other
pool's); a private drafter is counted with its target replica (``SpecModel.private`` and the
benchmark's cost per replica). Not modelled: drafter KV eviction and re-prefill, the prompt's first
draft call, drafter faults, and migration of a speculating request (a SimPool with both is refused).

Example::

    spec = SpecModel(k=4, acceptance=0.8, drafter_pool="drafters")
    pools = [SimPool("p", "prefill", svc), SimPool("d", "decode", svc, 4, spec=spec),
             SimPool("drafters", "drafter", DRAFTER_SVC, 2, draft=DraftCost(0.03, 0.0136, 0.006, 32))]
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftCost:
    base_s: float
    per_row_s: float
    link_s: float = 0.0
    max_rows: int = 64

    def __post_init__(self) -> None:
        for key in ("base_s", "per_row_s", "link_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"draft cost {key}={v!r}: must be a number of seconds >= 0")
        if self.max_rows < 1:
            raise ValueError(f"draft cost max_rows={self.max_rows!r}: must be >= 1")

    def round_s(self, rows: int, k: int) -> float:
        return k * (self.base_s + self.per_row_s * rows) + self.link_s if rows > 0 else 0.0


@dataclass(frozen=True)
class SpecModel:
    k: int = 4
    acceptance: float = 0.8
    concentration: float = 20.0  # Beta(a c, (1 - a) c): the spread of acceptance between requests
    verify_token_cost: float = 0.05
    drafter_pool: str | None = None
    private: DraftCost | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"spec k={self.k!r}: must be >= 1 (no speculation: leave SimPool.spec unset)")
        if not 0 < self.acceptance < 1:
            raise ValueError(f"spec acceptance={self.acceptance!r}: must be in (0, 1)")
        if (self.drafter_pool is None) == (self.private is None):
            raise ValueError("spec: set exactly one of drafter_pool (an M:N drafter pool) and private (a drafter "
                             "per target replica)")

    def tokens_per_step(self, a: float) -> float:
        return (1.0 - a ** (self.k + 1)) / (1.0 - a)


@dataclass
class SpecCounters:
    """Integrated over steps (cluster/sim/replica.py ``_advance``): the worker's speculation counters
    (router/prometheus.py SPEC_DECODE_COUNTERS) plus every decoded token (speculating or not)."""

    tokens: float = 0.0
    verifies: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    emitted_tokens: float = 0.0
    draft_wait_s: float = 0.0
    verify_s: float = 0.0
    fallbacks: int = 0  # requests that decoded plainly: no drafter replica with room
    declined: int = 0  # requests whose drafts would not pay at join
    speculated: int = 0

    def add(self, steps: float, tokens_per_step: float, batch: int, drafting: int, drafts_per_step: int,
            wait_s: float, verify_step_s: float) -> None:
        """``steps`` steps of a batch of ``batch`` sequences, ``drafting`` of them speculating
        (``drafts_per_step`` drafts in all), ``tokens_per_step`` tokens per step over the batch."""
        self.tokens += steps * tokens_per_step
        if drafting:
            # the speculating sequences' tokens per step: all of the batch's less one per plain sequence
            spec_tokens = tokens_per_step - (batch - drafting)
            self.verifies += steps * drafting
            self.draft_tokens += steps * drafts_per_step
            self.emitted_tokens += steps * spec_tokens
            self.accepted_tokens += steps * (spec_tokens - drafting)
            self.draft_wait_s += steps * wait_s
            self.verify_s += steps * verify_step_s

    def merge(self, other: SpecCounters) -> None:
        for key in self.__dataclass_fields__:
            setattr(self, key, getattr(self, key) + getattr(other, key))
