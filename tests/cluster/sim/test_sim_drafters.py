"""The simulator's M:N drafter pools (cluster/sim/spec.py, cluster/sim/drafting.py): it degenerates to
plain decoding with no drafter, conserves tokens, never beats k + 1 tokens per step, batches rows
from several targets on one drafter replica, falls back to no drafts when the pool is saturated,
and the real autoscaler sizes the drafter pool on draft demand and benefit."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.autoscale.loop import SLOAutoscaler
from cluster.autoscale.profile import ReplicaCapacity, ServiceModel, SLOTargets
from cluster.autoscale.slo import AutoscalerConfig, PoolScaling
from cluster.sim.pool import SimPool
from cluster.sim.simulator import Simulation
from cluster.sim.spec import DraftCost, SpecModel
from cluster.sim.trace import Trace, synthetic_trace
from testkit.tolerance import estimate

SVC = ServiceModel(prefill_base_s=0.02, prefill_per_token_s=0.0002, decode_base_s=0.02, decode_per_seq_s=0.004,
                   max_batch=16)
UNUSED = ServiceModel(0.0, 0.0, 0.0, 0.0, 1)  # a drafter pool's service model is not used
SLO = SLOTargets(ttft_p90_s=2.0, tpot_p90_s=0.1)
FAST = DraftCost(base_s=0.001, per_row_s=0.0002, link_s=0.001, max_rows=32)


def trace(seconds=600, rps=2.0, seed=0) -> Trace:
    return synthetic_trace(duration_s=seconds, base_rps=rps, peak_rps=rps, bursts_per_hour=0, mean_prompt=200,
                           mean_output=120, seed=seed)


def pools(drafters: int, cost: DraftCost = FAST, targets: int = 2, **spec) -> list[SimPool]:
    sp = SpecModel(k=4, acceptance=0.8, drafter_pool="drafters", **spec)
    return [SimPool("p", "prefill", SVC, 2), SimPool("d", "decode", SVC, targets, spec=sp),
            SimPool("drafters", "drafter", UNUSED, drafters, draft=cost)]


def test_no_drafter_replica_degenerates_to_plain_decoding_exactly():
    tr = trace()
    plain = Simulation(tr, [SimPool("p", "prefill", SVC, 2), SimPool("d", "decode", SVC, 2)], slo=SLO).run()
    none = Simulation(tr, pools(drafters=0), slo=SLO).run()
    assert np.array_equal(plain.ttft, none.ttft) and np.array_equal(plain.tpot, none.tpot, equal_nan=True)
    c = none.spec["d"]
    assert c.verifies == 0 and c.speculated == 0 and c.fallbacks == int((tr.output > 1).sum())


def test_tokens_out_equal_tokens_in_with_drafting_and_fallbacks():
    tr = trace(rps=3.0)
    res = Simulation(tr, pools(drafters=1, cost=DraftCost(0.001, 0.0002, 0.001, max_rows=3)), slo=SLO).run()
    c = res.spec["d"]
    assert c.speculated > 0 and c.fallbacks > 0  # some drafted, some found the one replica full
    assert max(res.timeline["drafters.alive"]) == 1
    want = float((tr.output[tr.output > 1] - 1).sum())  # decode tokens (the first comes from prefill)
    assert c.tokens == estimate(want, rel=1e-9, why="float sums of steps x tokens per step over a run")
    assert c.emitted_tokens == estimate(c.verifies + c.accepted_tokens, rel=1e-9, why="the same float sums of steps x tokens per step")
    assert 0 < c.accepted_tokens < c.draft_tokens
    assert all(np.isfinite(res.tpot[tr.output > 1]))  # every request finished


def test_speed_up_is_bounded_by_k_plus_one():
    one = Trace("one", np.array([0.0]), np.array([100]), np.array([401]))
    plain = Simulation(one, [SimPool("c", "colocated", SVC, 1)], slo=SLO).run()
    free = DraftCost(0.0, 0.0, 0.0)
    runs = {}
    for a in (0.5, 0.9, 0.99):
        sp = SpecModel(k=4, acceptance=a, concentration=1e6, verify_token_cost=0.0, drafter_pool="dr")
        sim = Simulation(one, [SimPool("c", "colocated", SVC, 1, spec=sp),
                               SimPool("dr", "drafter", UNUSED, 1, draft=free)], slo=SLO)
        res = sim.run()
        runs[a] = plain.tpot[0] / res.tpot[0]
        assert 1.0 < runs[a] <= 5.0  # k + 1 tokens per step at most
        drawn = float(sim.drafting.acceptance["c"][0])
        assert runs[a] == estimate(sp.tokens_per_step(drawn), rel=1e-9,
                                   why="400 tokens at E per step against 400 plain steps: float division only")
    assert runs[0.5] < runs[0.9] < runs[0.99]


def test_one_drafter_replica_batches_rows_from_several_targets():
    tr = trace(rps=3.0)
    sim = Simulation(tr, pools(drafters=1, targets=4), slo=SLO)
    seen: list[int] = []
    assert sim.drafting.unserved == {}
    join = sim.drafting.join

    def spy(r, i, now):
        out = join(r, i, now)
        seen.append(len(sim.drafting.served.get("drafters-0", {})))
        return out
    sim.drafting.join = spy  # observe only: the real join runs
    res = sim.run()
    assert max(seen) >= 2  # rows from two or more target replicas at once on the one drafter
    assert res.spec["d"].verifies > 0 and not sim.drafting.reqs  # every row freed at the end
    assert not any(sim.drafting.unserved.values())


def test_requests_without_room_are_reported_as_unserved_demand():
    sim = Simulation(trace(rps=3.0), pools(drafters=1, cost=DraftCost(0.001, 0.0002, 0.001, max_rows=2)), slo=SLO)
    seen: list[float] = []
    tick = sim._tick

    def spy():
        tick()
        seen.append(sim.pools["drafters"].history[-1].unserved)
    sim._tick = spy  # observe only: the real tick runs
    res = sim.run()
    assert max(seen) > 0 and res.spec["d"].fallbacks > 0
    assert not any(sim.drafting.unserved.values())  # every unserved request left the set when it finished


def test_a_drafter_too_slow_to_pay_is_declined():
    slow = DraftCost(base_s=0.5, per_row_s=0.05, link_s=0.01)
    res = Simulation(trace(), pools(drafters=2, cost=slow), slo=SLO).run()
    c = res.spec["d"]
    assert c.speculated == 0 and c.declined > 0 and c.verifies == 0


def test_private_drafters_batch_only_their_own_replica():
    sp = SpecModel(k=4, acceptance=0.8, private=FAST)
    res = Simulation(trace(), [SimPool("p", "prefill", SVC, 2), SimPool("d", "decode", SVC, 2, spec=sp)], slo=SLO).run()
    assert res.spec["d"].verifies > 0 and set(res.replica_seconds) == {"p", "d"}


def test_drafter_pool_settings_are_checked():
    with pytest.raises(ValueError, match="exactly those"):
        Simulation(trace(60), [SimPool("p", "prefill", SVC), SimPool("d", "decode", SVC)] + pools(1)[2:], slo=SLO)
    with pytest.raises(ValueError, match="exactly one of drafter_pool"):
        SpecModel(drafter_pool="x", private=FAST)
    with pytest.raises(ValueError, match="needs a draft cost"):
        SimPool("x", "drafter", UNUSED)


def _autoscaled(cost: DraftCost) -> tuple[Simulation, dict]:
    cap = ReplicaCapacity(requests_per_s=0.6, mean_prompt_tokens=200, mean_output_tokens=120)
    cfg = AutoscalerConfig((
        PoolScaling("p", "prefill", SLOTargets(ttft_p90_s=2.0), cap, 1, 8),
        PoolScaling("d", "decode", SLOTargets(tpot_p90_s=0.1), cap, 1, 16),
        PoolScaling("drafters", "drafter", follows="d", ratio=1.0, min_replicas=1, max_replicas=16,
                    rows_per_replica=1.0, min_verifies=20)), down_cooldown_s=60, down_interval_s=20)
    sim = Simulation(trace(1200, rps=2.0), pools(drafters=6, cost=cost, targets=4), slo=SLO, scaling=SLOAutoscaler(cfg))
    return sim, sim.run().timeline


def test_the_autoscaler_sizes_the_drafter_pool_on_demand_and_benefit():
    fast_sim, fast = _autoscaled(FAST)
    slow_sim, slow = _autoscaled(DraftCost(base_s=0.5, per_row_s=0.05, link_s=0.01))
    late = [x for t, x in zip(fast["t"], fast["drafters.desired"]) if 300 <= t <= 1200]
    assert np.median(late) >= 2  # ~2-4 rows drafting at 1 row per replica: the pool holds 2+
    assert "speed-up" in fast_sim.loop.last["drafters"].reason
    late = [x for t, x in zip(slow["t"], slow["drafters.desired"]) if 300 <= t <= 1200]
    assert set(late) == {1}  # no request drafts on a drafter this slow: the pool shrinks to its minimum and stays

