"""Standby replicas and scale to zero in the simulator (cluster/sim/control.py, simulator.py): a
scale-up promotes loaded standby replicas, which serve after standby_s instead of startup_s, and a
replacement loads behind them; their replica-seconds are counted at standby_cost; a request for a
pool at zero wakes it (from its standby when it keeps one) and is served, not lost; and with the
real autoscaler, standby replicas absorb a step that new replicas alone meet only after a start-up."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.autoscale.loop import SLOAutoscaler
from cluster.autoscale.profile import ReplicaCapacity, ServiceModel, SLOTargets
from cluster.autoscale.slo import AutoscalerConfig, Decision, PoolScaling
from cluster.sim.pool import SimPool
from cluster.sim.report import sim_capacity
from cluster.sim.simulator import Simulation
from cluster.sim.trace import synthetic_trace
from testkit.tolerance import estimate

SVC = ServiceModel(prefill_base_s=0.02, prefill_per_token_s=0.0002, decode_base_s=0.02, decode_per_seq_s=0.001,
                   max_batch=32)
SLO = SLOTargets(ttft_p90_s=1.0, tpot_p90_s=0.06)


class Schedule:
    """A ScalingPolicy that asks for given sizes at given times (what the oracle does)."""

    pools = ("main",)

    def __init__(self, steps: list[tuple[float, int]]) -> None:
        self.steps = steps

    def decide(self, now, metrics, status):
        want = next((n for t, n in reversed(self.steps) if now >= t), status["main"].desired)
        return {"main": Decision("main", status["main"].desired, want, "schedule")}


def step_trace(seed: int = 0):
    # 2 req/s for 10 min, then 6 req/s for 10 min: one sharp step
    return synthetic_trace(duration_s=1200, base_rps=2, peak_rps=2, bursts_per_hour=0, bursts=((600, 600, 3.0),),
                           mean_prompt=300, mean_output=200, seed=seed)


def test_a_scale_up_promotes_standby_replicas_first():
    trace = step_trace()
    pool = SimPool("main", "colocated", SVC, replicas=1, startup_s=120.0, standby_s=1.0, standby=2, standby_cost=0.5)
    sim = Simulation(trace, [pool], slo=SLO, scaling=Schedule([(600.0, 3)]))
    res = sim.run()
    t = np.asarray(res.timeline["t"])
    ready = np.asarray(res.timeline["main.ready"])
    standby = np.asarray(res.timeline["main.standby"])
    assert res.promotions["main"] == 2
    assert ready[(t > 605) & (t < 700)].min() == 3  # both promoted spares serve within seconds of the step
    assert standby[(t > 605) & (t < 700)].max() == 2  # replacements loading (counted as standby) ...
    # ... and costed at standby_cost for every second they exist (2 spares x 1200 s x 0.5, about)
    assert res.standby_seconds["main"] == estimate(2 * res.end_s * 0.5, rel=0.05, why="the spares exist from "
                                                   "their creation a few simulated seconds in, not from t = 0")
    assert res.replica_hours == pytest.approx((sum(res.replica_seconds.values()) + res.standby_seconds["main"]) / 3600)


def test_without_standby_the_same_step_waits_a_start_up():
    trace = step_trace()
    pool = SimPool("main", "colocated", SVC, replicas=1, startup_s=120.0)
    res = Simulation(trace, [pool], slo=SLO, scaling=Schedule([(600.0, 3)])).run()
    t, ready = np.asarray(res.timeline["t"]), np.asarray(res.timeline["main.ready"])
    assert ready[(t > 605) & (t < 700)].max() == 1 and ready[t > 730].min() == 3
    assert res.standby_seconds["main"] == 0 and res.promotions["main"] == 0


def test_a_request_for_a_pool_at_zero_wakes_it_and_is_served():
    trace = synthetic_trace(duration_s=1800, base_rps=0.01, peak_rps=0.01, bursts_per_hour=0, mean_prompt=100,
                            mean_output=20, seed=3)  # a request every ~100 s: the pool idles to zero between them
    cap = ReplicaCapacity(requests_per_s=5.0, mean_prompt_tokens=100, mean_output_tokens=20)
    config = AutoscalerConfig(pools=(PoolScaling("main", "colocated", SLO, cap, 0, 4, max_standby=1),),
                              scale_to_zero_after_s=30.0)
    pool = SimPool("main", "colocated", SVC, replicas=1, startup_s=30.0, standby_s=1.0, standby=1)
    sim = Simulation(trace, [pool], slo=SLO, scaling=SLOAutoscaler(config))
    res = sim.run()
    desired = np.asarray(res.timeline["main.desired"])
    assert (desired == 0).any() and sim.pools["main"].wakes >= 3  # it slept and was woken, again and again
    assert not np.isnan(res.ttft).any()  # every request served: none lost at zero
    woken = res.ttft[res.ttft > 0.5]  # the ones that arrived at zero waited for a wake ...
    assert len(woken) >= 3 and woken.max() < 5.0  # ... from the standby (1 s), never a 30 s start-up


def test_the_autoscaler_keeps_standby_after_a_burst_and_they_absorb_the_next():
    # 2 req/s with two 3x bursts of 5 min, 20 min apart: the first teaches the risk, the second meets spares
    trace = synthetic_trace(duration_s=2700, base_rps=2, peak_rps=2, bursts_per_hour=0,
                            bursts=((600, 300, 3.0), (1800, 300, 3.0)), mean_prompt=300, mean_output=200, seed=1)
    cap, _ = sim_capacity(SVC, "colocated", SLO, mean_prompt=300, mean_output=200, requests=1500)
    runs = {}
    for n in (0, 6):
        config = AutoscalerConfig(pools=(PoolScaling("main", "colocated", SLO, cap, 1, 20, max_standby=n,
                                                     standby_cost=0.1),), horizon_s=120.0, scale_down="migrate")
        pool = SimPool("main", "colocated", SVC, replicas=1, startup_s=120.0, standby_s=1.0)
        runs[n] = Simulation(trace, [pool], slo=SLO, scaling=SLOAutoscaler(config)).run()
    with_spares, without = runs[6], runs[0]
    t = np.asarray(with_spares.timeline["t"])
    spares = np.asarray(with_spares.timeline["main.standby"])
    assert spares[(t > 700) & (t < 1800)].max() >= 2  # kept after the first burst (loaded for a start-up)
    assert with_spares.promotions["main"] >= 2  # ... and promoted at the second
    second = (trace.t >= 1800) & (trace.t < 1950)  # the second burst's first 150 s: a start-up plus a round
    assert with_spares.met[second].mean() > without.met[second].mean() + 0.1
    assert with_spares.standby_hours > 0 and without.standby_hours == 0  # their cost is counted
