"""Expert-parallel load balancing (EPLB-style replication of hot experts).

Terms. The *load* of an expert is the number of token-expert assignments routed to it over a
window of steps. A rank's load is the sum, over the experts it holds, of the expert's load divided
by the expert's number of replicas (assignments are split evenly across replicas, see
moe_dispatch.py). Imbalance = max rank load / mean rank load (1.0 is perfect).

Algorithm (greedy, per layer): start from the home placement; repeatedly take the most loaded
rank, and for its experts from the largest per-replica share down, try placing one more replica on
the least loaded rank that does not hold it yet and still has a free extra slot (at most
``max_extra_per_rank`` replicas per rank, the memory budget). Accept the first move that lowers
the sum of squared rank loads without raising the maximum; stop when no move helps. Replicating
never drops a home copy, so any plan is valid and switching plans only copies weights from homes.

Worked example: W = 2, E = 4 (experts 0-1 on rank 0, 2-3 on rank 1), loads [60, 20, 10, 10]:
rank loads [80, 20], imbalance 1.6. Replicating expert 0 on rank 1 splits it 30/30 -> [50, 50], 1.0.

The ``Rebalancer`` applies this every ``interval_steps`` steps to the window since its last look,
and proposes a new plan only when the current one is worse than ``threshold`` on that window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.errors import ConfigError
from workers.parallel.expert_placement import ExpertPlacement


def rank_loads(load: Sequence[float], placement: ExpertPlacement) -> list[float]:
    out = [0.0] * placement.world_size
    for e, ranks in enumerate(placement.replicas):
        for r in ranks:
            out[r] += load[e] / len(ranks)
    return out


def imbalance(load: Sequence[float], placement: ExpertPlacement) -> float:
    """max / mean rank load (1.0 when there is no load)."""
    loads = rank_loads(load, placement)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def plan_replicas(load: Sequence[float], home: ExpertPlacement, max_extra_per_rank: int) -> ExpertPlacement:
    """The home placement plus replicas of hot experts that balance ``load`` (see the module doc)."""
    reps = [[r[0]] for r in home.replicas]
    extra = [0] * home.world_size
    while True:
        loads = rank_loads(load, ExpertPlacement(home.world_size, tuple(map(tuple, reps))))
        peak, sumsq = max(loads), sum(x * x for x in loads)
        hot = loads.index(peak)
        move = _best_move(load, reps, loads, hot, extra, max_extra_per_rank, peak, sumsq)
        if move is None:
            return ExpertPlacement(home.world_size, tuple(map(tuple, reps)))
        e, r = move
        reps[e].append(r)
        extra[r] += 1


def _best_move(load, reps, loads, hot, extra, max_extra, peak, sumsq) -> tuple[int, int] | None:
    mine = sorted((e for e, rs in enumerate(reps) if hot in rs), key=lambda e: -load[e] / len(reps[e]))
    by_load = sorted(range(len(loads)), key=loads.__getitem__)
    for e in mine:
        n = len(reps[e])
        old, new = load[e] / n, load[e] / (n + 1)
        for r in by_load:
            if r in reps[e] or extra[r] >= max_extra:
                continue
            trial = list(loads)
            for holder in reps[e]:
                trial[holder] += new - old
            trial[r] += new
            if max(trial) <= peak + 1e-9 and sum(x * x for x in trial) < sumsq - 1e-9:
                return e, r
    return None


@dataclass(frozen=True)
class RebalanceConfig:
    """interval_steps: steps between looks; max_extra_per_rank: replica slots each rank may add per
    layer (memory: that many extra experts' weights); threshold: rebalance only when the current
    placement's imbalance on the last window exceeds it."""

    interval_steps: int = 16
    max_extra_per_rank: int = 2
    threshold: float = 1.1

    def __post_init__(self) -> None:
        if self.interval_steps < 1:
            raise ConfigError(f"moe.rebalance_interval_steps={self.interval_steps}: must be >= 1")
        if self.max_extra_per_rank < 0:
            raise ConfigError(f"moe.max_extra_experts_per_rank={self.max_extra_per_rank}: must be >= 0")
        if self.threshold < 1.0:
            raise ConfigError(f"moe.rebalance_threshold={self.threshold}: must be >= 1.0")


class Rebalancer:
    """Watches the MoE layers' expert counts and proposes per-layer placements."""

    def __init__(self, moe_layers: list, config: RebalanceConfig) -> None:
        self.layers = moe_layers
        self.config = config
        self._steps = 0
        self._last = [layer.expert_counts.clone() for layer in moe_layers]
        self.num_rebalances = 0

    def window_loads(self) -> list[list[int]]:
        """Per layer, assignments per expert since the last look: [layers][E]."""
        return [(layer.expert_counts - last).tolist() for layer, last in zip(self.layers, self._last)]

    def maybe_plan(self) -> list[ExpertPlacement] | None:
        """Call once per step; every interval_steps steps returns new placements if they help."""
        self._steps += 1
        if self._steps % self.config.interval_steps:
            return None
        loads = self.window_loads()
        self._last = [layer.expert_counts.clone() for layer in self.layers]
        current = [layer.placement for layer in self.layers]
        if max(imbalance(ld, p) for ld, p in zip(loads, current)) <= self.config.threshold:
            return None
        plans = [plan_replicas(ld, layer.home, self.config.max_extra_per_rank) for ld, layer in zip(loads, self.layers)]
        if plans == current:
            return None
        self.num_rebalances += 1
        return plans


def total_counts(moe_layers: list) -> torch.Tensor:
    """Assignments per expert summed over layers since start: [E] (for stats)."""
    return torch.stack([layer.expert_counts for layer in moe_layers]).sum(0)
