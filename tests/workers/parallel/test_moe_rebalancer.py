"""EPLB-style rebalancer (workers/parallel/eplb.py): the worked example, skewed loads brought to
max/mean <= 1.25, the replica budget, and the Rebalancer's windowed trigger."""

from __future__ import annotations

import random

import pytest
import torch

from workers.parallel.eplb import RebalanceConfig, Rebalancer, imbalance, plan_replicas, rank_loads
from workers.parallel.expert_placement import ExpertPlacement


def test_worked_example():
    home = ExpertPlacement.contiguous(4, 2)
    assert imbalance([60, 20, 10, 10], home) == pytest.approx(1.6)
    plan = plan_replicas([60, 20, 10, 10], home, max_extra_per_rank=2)
    assert plan.replicas[0] == (0, 1)
    assert rank_loads([60, 20, 10, 10], plan) == [50.0, 50.0]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_skewed_loads_balanced(world, seed):
    rng = random.Random(seed)
    load = [rng.paretovariate(1.2) * 100 for _ in range(8)]  # heavy-tailed expert popularity
    home = ExpertPlacement.contiguous(8, world)
    plan = plan_replicas(load, home, max_extra_per_rank=2)
    assert imbalance(load, plan) <= max(1.25, imbalance(load, home))
    assert imbalance(load, plan) <= imbalance(load, home)
    assert all(len(plan.slots(r)) - len(home.slots(r)) <= 2 for r in range(world))
    assert all(p[0] == h[0] for p, h in zip(plan.replicas, home.replicas))


def test_skewed_two_hot_experts_reach_target():
    load = [400, 300, 20, 20, 10, 10, 10, 10]  # both hot experts live on rank 0
    home = ExpertPlacement.contiguous(8, 2)
    assert imbalance(load, home) > 1.8
    assert imbalance(load, plan_replicas(load, home, 2)) <= 1.25


def test_zero_budget_keeps_home():
    home = ExpertPlacement.contiguous(8, 2)
    assert plan_replicas([100, 1, 1, 1, 1, 1, 1, 1], home, max_extra_per_rank=0) == home


class _FakeLayer:
    def __init__(self, e: int, w: int) -> None:
        self.home = self.placement = ExpertPlacement.contiguous(e, w)
        self.expert_counts = torch.zeros(e, dtype=torch.long)


def test_rebalancer_window_and_threshold():
    layer = _FakeLayer(4, 2)
    reb = Rebalancer([layer], RebalanceConfig(interval_steps=2, threshold=1.2))
    layer.expert_counts += torch.tensor([10, 10, 10, 10])
    assert reb.maybe_plan() is None and reb.maybe_plan() is None  # balanced window
    layer.expert_counts += torch.tensor([60, 20, 10, 10])
    assert reb.maybe_plan() is None  # not yet at the interval
    plans = reb.maybe_plan()
    assert plans is not None and plans[0].replicas[0] == (0, 1) and reb.num_rebalances == 1


def test_bad_config():
    from workers.errors import ConfigError

    with pytest.raises(ConfigError, match="interval"):
        RebalanceConfig(interval_steps=0)
