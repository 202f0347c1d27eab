"""Drafter pools: how many replicas their draft demand needs, and whether drafting pays at all.

A drafter pool (``role: drafter``) serves the draft rounds of the target pool that names it in
``speculative.drafter_pool`` (its *lead*). It has no latency SLO of its own: what it is for is the
lead's speed-up, so it is sized on two measurements instead of a capacity profile and SLOs.

Terms (one metrics window; ``DraftWindow`` carries them):
    rows            requests holding drafter state on the pool's replicas (their mean over the
                    latency buckets, summed over replicas): the rows a draft round batches
    unserved        requests decoding without drafts because no replica of the pool had room for
                    them (their mean over the latency buckets): demand the rows do not show. The
                    simulator reports it; the live router has no row cap (a full replica evicts and
                    re-prefills instead), so live it is 0 and saturation shows in the rows
    rows_per_replica  the drafter pool's capacity: rows one replica batches within a round latency
                    that still pays (a setting, like a target pool's profile; measured with
                    benchmarks/drafter_pool_bench.py)
    E               tokens per verify on the lead = emitted / verifies (accepted drafts + the
                    target's own token; 1.0 = plain decoding)
    k               drafts per verify = draft tokens / verifies
    f_wait          the lead's share of speculative time spent waiting for drafts =
                    draft_wait_s / (draft_wait_s + verify_s): the draft round latency the overlap
                    did not hide, next to the target step time
    kappa           ``verify_token_cost``: what verifying one draft token adds to a target step,
                    as a fraction of a plain decode row (a memory-bound GPU step: ~0.05; the
                    q4 CPU kernel: ~0.3, benchmarks/README.md "The pair: where the time goes")

Measured benefit (the speed-up of the lead's speculating requests over plain decoding):

    speedup = E x (1 - f_wait) / (1 + kappa x k)

A verify cycle of wait + step yields E tokens where plain decoding yields one token per plain step
~ step / (1 + kappa k); acceptance enters through E, the target step time and the draft round
latency through f_wait.

The decision, per drafter pool, after its lead's (cluster/autoscale/slo.py step 5):
 1. Demand: the rows the lead will need once it has its new size = (rows + unserved) / the
    lead's serving replicas (ready + starting) x the lead's desired replicas; the pool needs
    ceil(that x (1 + headroom) / rows_per_replica) replicas.
 2. Benefit: with at least ``min_verifies`` verifies in the window and the pool not over its
    capacity (rows + unserved <= rows_per_replica x ready replicas: a saturated pool makes rounds
    slow, and the cure is more replicas, not fewer), a speed-up under ``min_speedup`` means drafting does not
    pay: the pool shrinks toward ``min_replicas`` (one ``max_down_step_frac`` step per
    ``down_interval_s``). The targets then stop asking on their own: their adaptive draft length
    (workers/engine/draft_length.py) charges the measured wait, and requests that find no replica
    with room decode without drafts (router/policies/drafter.py, ``drafter_none``).
 3. No draft metrics at all (a provider that does not read the drafter and speculation counters,
    or no window yet): ``ceil(ratio x`` the lead's desired``)``, the configured prior, said so in
    the reason.

Worked example: the lead has 10 replicas serving and asks for 12; its window saw 40 rows drafting,
E = 2.6 at k = 4, f_wait = 0.2, kappa = 0.05: speedup = 2.6 x 0.8 / 1.2 = 1.73 (pays). Demand:
40 / 10 x 12 = 48 rows, x 1.1 headroom / 16 rows per replica -> ceil(3.3) = 4 replicas. Had the
drafts waited 60% of the time (f_wait 0.6): 2.6 x 0.4 / 1.2 = 0.87 < 1.1, and a pool of 4 at
rows 40 <= 64 shrinks 4 -> 3, then on toward its minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftWindow:
    """Speculation and drafter numbers of one pool's metrics window (module docstring).

    On a drafter pool: ``rows`` (mean requests holding drafter state, all replicas), ``unserved``
    (mean requests that found no replica with room; simulator only) and ``busy``
    (drafter compute seconds per second, all replicas; reported, not decided on). On a target
    pool: counter increases over the window: verifies, draft tokens, accepted and emitted tokens,
    seconds waiting for drafts and seconds of steps that verified drafts."""

    rows: float = 0.0
    unserved: float = 0.0
    busy: float = 0.0
    verifies: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    emitted_tokens: float = 0.0
    draft_wait_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted_tokens / self.verifies if self.verifies else 0.0

    @property
    def drafts_per_verify(self) -> float:
        return self.draft_tokens / self.verifies if self.verifies else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def wait_share(self) -> float:
        total = self.draft_wait_s + self.verify_s
        return self.draft_wait_s / total if total > 0 else 0.0


def draft_speedup(w: DraftWindow, verify_token_cost: float) -> float | None:
    """The module docstring's measured speed-up of the speculating requests (None: no verifies)."""
    if w.verifies <= 0:
        return None
    return w.tokens_per_verify * (1.0 - w.wait_share) / (1.0 + verify_token_cost * w.drafts_per_verify)


def demand_replicas(rows: float, lead_serving: int, lead_desired: int, rows_per_replica: float,
                    headroom: float) -> int:
    """Step 1: replicas for the rows the lead will draft at its desired size."""
    assert rows_per_replica > 0
    planned = rows / max(lead_serving, 1) * lead_desired
    return math.ceil(planned * (1.0 + headroom) / rows_per_replica - 1e-9)
