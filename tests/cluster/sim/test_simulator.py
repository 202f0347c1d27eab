"""The cluster simulator: replica model, determinism, conservation, queueing theory, scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.autoscale.loop import SLOAutoscaler
from cluster.autoscale.slo import AutoscalerConfig, PoolScaling
from cluster.autoscale.profile import ReplicaCapacity, ServiceModel, SLOTargets
from cluster.sim.replica import SimReplica
from cluster.autoscale.slo import Decision
from cluster.sim.pool import MigrationModel, kv_bytes_per_token_of
from cluster.sim.report import OracleScaling, oracle_schedule, plot_timeline, sim_capacity
from cluster.sim.trace import Trace, synthetic_trace
from cluster.sim.pool import SimPool
from cluster.sim.simulator import Simulation
from router.policies.round_robin import RoundRobinPolicy

from testkit.tolerance import SECONDS_FP64, estimate

SVC = ServiceModel(prefill_base_s=0.02, prefill_per_token_s=0.0002, decode_base_s=0.02, decode_per_seq_s=0.001,
                   max_batch=32)
SLO = SLOTargets(ttft_p90_s=1.0, tpot_p90_s=0.06)


def small_trace(seconds=1800, rps=4.0, seed=0) -> Trace:
    return synthetic_trace(duration_s=seconds, base_rps=rps, peak_rps=rps, bursts_per_hour=0, mean_prompt=300,
                           mean_output=80, seed=seed)


def test_replica_virtual_clock_matches_the_docstring_example():
    r = SimReplica("w", "p", ServiceModel(0.0, 0.0, 0.010, 0.001, 8), colocated=False, now=0.0)
    r.join_decode(1, 5, 10, 0.0)
    r.join_decode(2, 3, 10, 0.0)
    t = r.next_decode_done(0.0)
    assert t == pytest.approx(0.036)  # 3 steps of 12 ms
    assert r.finish_decodes(t) == [2]
    assert r.held_tokens(t) == 10 + 3 and r.outstanding_tokens(t) == 2
    t2 = r.next_decode_done(t)
    assert t2 == pytest.approx(0.058)  # 2 more steps of 11 ms
    assert r.finish_decodes(t2) == [1] and r.idle()


def test_colocated_prefill_pauses_decode_and_batch_limit_queues():
    r = SimReplica("w", "p", ServiceModel(0.1, 0.0, 0.01, 0.0, 1), colocated=True, now=0.0)
    assert r.enqueue_prefill(1, 10, 0.0) == pytest.approx(0.1)
    req, nxt = r.finish_prefill(0.1)
    assert (req, nxt) == (1, None)
    r.join_decode(1, 10, 10, 0.1, counted=False)
    assert r.next_decode_done(0.1) == pytest.approx(0.2)
    assert r.enqueue_prefill(2, 10, 0.15) == pytest.approx(0.25)  # prefill starts: decode paused
    assert r.next_decode_done(0.15) is None
    r.finish_prefill(0.25)
    r.join_decode(2, 10, 10, 0.25, counted=False)  # batch of 1 is full: 2 waits
    assert r.num_waiting() == 1
    assert r.next_decode_done(0.25) == pytest.approx(0.30)  # 5 tokens left, resumed after 0.1 s pause
    assert r.finish_decodes(0.30) == [1] and r.num_running() == 1


def test_deterministic_per_seed():
    tr = small_trace()
    runs = [Simulation(tr, [SimPool("main", "colocated", SVC, 4)], slo=SLO, route_candidates=2, seed=s).run()
            for s in (7, 7, 8)]
    assert np.array_equal(runs[0].ttft, runs[1].ttft) and np.array_equal(runs[0].tpot, runs[1].tpot, equal_nan=True)
    assert not np.array_equal(runs[0].ttft, runs[2].ttft)  # another seed samples other candidates


def test_uses_the_real_routing_policies():
    tr = small_trace(seconds=300)
    sim = Simulation(tr, [SimPool("main", "colocated", SVC, 3, policy="round_robin")], slo=SLO)
    assert isinstance(sim.pools["main"].policy, RoundRobinPolicy)
    counts: dict[str, int] = {}
    orig = sim.pools["main"].policy.select

    def spy(request, workers):
        wid = orig(request, workers)
        counts[wid] = counts.get(wid, 0) + 1
        return wid
    sim.pools["main"].policy.select = spy  # type: ignore[method-assign]
    sim.run()
    assert sorted(counts.values())[-1] - sorted(counts.values())[0] <= 1 and sum(counts.values()) == len(tr)


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_conservation_with_autoscaling_and_drains(topology):
    """A load ramp up and down with the SLO autoscaler: every request completes exactly once, no
    replica leaves with a request (SimActuator.remove asserts it), and the pools shrink back."""
    tr = synthetic_trace(duration_s=5400, base_rps=0.5, peak_rps=8, period_s=5400, peak_at_s=2700,
                         bursts_per_hour=4, mean_prompt=300, mean_output=80, seed=1)
    cap = ReplicaCapacity(1.0, 300, 80)
    if topology == "colocated":
        pools = [SimPool("main", "colocated", SVC, 1, startup_s=30)]
        scaling = (PoolScaling("main", "colocated", SLO, cap, 1, 40),)
    else:
        pools = [SimPool("p", "prefill", SVC, 1, startup_s=30), SimPool("d", "decode", SVC, 1, startup_s=30)]
        scaling = (PoolScaling("p", "prefill", SLOTargets(ttft_p90_s=1.0), cap, 1, 40),
                   PoolScaling("d", "decode", SLOTargets(tpot_p90_s=0.06), cap, 1, 40))
    sim = Simulation(tr, pools, slo=SLO, scaling=SLOAutoscaler(AutoscalerConfig(pools=scaling, down_cooldown_s=120)))
    res = sim.run()
    assert sim.completed == len(tr) and not np.isnan(res.ttft).any()
    assert (res.ttft > 0).all() and np.all(np.isnan(res.tpot) | (res.tpot > 0))
    alive = {k: v for k, v in res.timeline.items() if k.endswith(".alive")}
    assert max(max(v) for v in alive.values()) >= 4  # it scaled up for the peak ...
    assert all(v[-1] <= 3 for v in alive.values())  # ... and drained back down
    hours = sum(res.replica_seconds.values()) / 3600
    assert hours == pytest.approx(res.replica_hours)
    assert hours < sum(max(v) for v in alive.values()) * res.end_s / 3600  # less than peak-sized all along


def _erlang_c(c: int, a: float) -> float:
    top = a ** c / math.factorial(c) * c / (c - a)
    return top / (sum(a ** k / math.factorial(k) for k in range(c)) + top)


def test_prefill_pool_matches_m_m_c():
    """A prefill pool of c = 4 replicas, exponential service of mean 1 s (prefill time is linear in
    the prompt, prompts exponential with mean 1000 tokens), Poisson arrivals at rho = 0.8, routed
    by least_loaded: routing each request to the replica with the least work left is the same
    queue as one FCFS queue feeding c servers (M/M/c), so TTFT = wait + service follows Erlang C:
    P(wait) = C(4, 3.2) = 0.596, mean wait = C / (c mu - lambda) = 0.745 s.
    Tolerance: 200k requests at rho 0.8; the batch-means standard error of the mean wait is ~3%
    (M/M/c waits are strongly autocorrelated at this load: busy periods span hundreds of
    requests), so 10% (> 3 sigma) on the mean wait and 0.02 absolute on P(wait)."""
    rng = np.random.default_rng(5)
    n, lam, c = 200_000, 3.2, 4
    t = np.cumsum(rng.exponential(1 / lam, n))
    prompt = np.maximum(1, np.rint(rng.exponential(1000.0, n))).astype(np.int64)
    tr = Trace("mmc", t, prompt, np.full(n, 2, dtype=np.int64))
    svc = ServiceModel(0.0, 0.001, 0.0, 0.0, 1)  # decode: 1 token, no time
    res = Simulation(tr, [SimPool("p", "prefill", svc, c), SimPool("d", "decode", ServiceModel(0, 0, 1e-9, 0, 1 << 20), 1)],
                     slo=SLO).run()
    wait = res.ttft - prompt * 0.001
    warm = slice(1000, None)  # skip the empty-system start
    cq = _erlang_c(c, lam)
    assert (wait[warm] > 1e-9).mean() == estimate(cq, abs=0.02, why="P(wait) of 200k M/M/c requests (docstring)")
    assert wait[warm].mean() == estimate(cq / (c - lam), rel=0.10, why="batch-means sd ~3% (docstring): > 3 sd")


def test_pending_replicas_beyond_cluster_capacity():
    tr = small_trace(seconds=900, rps=6)
    cap = ReplicaCapacity(1.0, 300, 80)
    cfg = AutoscalerConfig(pools=(PoolScaling("main", "colocated", SLO, cap, 1, 40),))
    sim = Simulation(tr, [SimPool("main", "colocated", SVC, 1, startup_s=30)], slo=SLO,
                     scaling=SLOAutoscaler(cfg), max_total_replicas=3)
    res = sim.run()
    assert max(res.timeline["main.alive"]) == 3
    assert sim.actuator.status("main").pending > 0 or any(
        "pending" in d.reason for d in sim.loop.last.values())  # type: ignore[union-attr]
    assert sim.completed == len(tr)


def test_oracle_and_sim_capacity_and_plot(tmp_path):
    cap, in_flight = sim_capacity(SVC, "colocated", SLO, mean_prompt=300, mean_output=80, requests=1500, iters=8)
    assert cap.requests_per_s > 0 and in_flight > 0
    tr = small_trace(seconds=1800, rps=3 * cap.requests_per_s)
    cfg = AutoscalerConfig(pools=(PoolScaling("main", "colocated", SLO, cap, 1, 40),))
    sizes, hours = oracle_schedule(tr, cfg, 300.0)
    assert 2 <= sizes["main"].mean() <= 4 and hours == pytest.approx(sizes["main"].sum() * 300 / 3600)
    res = Simulation(tr, [SimPool("main", "colocated", SVC, int(sizes["main"][0]), startup_s=30)], slo=SLO,
                     scaling=OracleScaling(sizes, 300.0, 30.0)).run()
    assert res.attainment > 0.85  # capacity is p90-based: ~90% of requests within the SLO at capacity
    png = plot_timeline({"oracle": res}, tmp_path / "t.png", oracle=sizes, slo=SLO)
    assert png.stat().st_size > 10_000


def test_bad_topology():
    with pytest.raises(ValueError, match="roles"):
        Simulation(small_trace(60), [SimPool("d", "decode", SVC)], slo=SLO)


# ------------------------------------------------------------------ scale-down by migration
class ShrinkAt:
    """ScalingPolicy that asks for ``to`` replicas of ``pool`` from time ``at`` on."""

    def __init__(self, pool: str, at: float, to: int) -> None:
        self.pools, self.pool, self.at, self.to = (pool,), pool, at, to

    def decide(self, now, metrics, status):
        want = self.to if now >= self.at else status[self.pool].desired
        return {self.pool: Decision(self.pool, status[self.pool].desired, want, "scripted")}


def test_migration_cost_model():
    m = MigrationModel()
    assert m.kv_bytes_per_token == kv_bytes_per_token_of(32, 8, 128) == 131072
    assert m.seconds(3000) == pytest.approx(3000 * 131072 / 1e9 + 0.2)
    assert MigrationModel(1000, 1e6, 0.0).seconds(500) == pytest.approx(0.5)
    for kw, key in (({"bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s"), ({"pause_s": -1}, "pause_s"),
                    ({"kv_bytes_per_token": float("nan")}, "kv_bytes_per_token")):
        with pytest.raises(ValueError, match=rf"migration\.{key}="):
            MigrationModel(**kw)


def test_replica_hands_over_a_sequence_exactly():
    """remove_decode gives back the tokens still to go and the context the KV holds; the sums the
    routing load numbers come from stay exact; a waiting sequence takes the freed slot."""
    r = SimReplica("w", "p", ServiceModel(0.0, 0.0, 0.010, 0.0, 2), colocated=False, now=0.0)
    r.join_decode(1, 100, 50, 0.0)
    r.join_decode(2, 40, 10, 0.0)
    r.join_decode(3, 30, 20, 0.0)  # batch of 2 is full: waits
    assert r.longest_decode(0.25) == (1, pytest.approx(75.0), 75)  # 25 steps of 10 ms: 25 generated
    left, context = r.remove_decode(1, 0.25)
    assert (left, context) == (pytest.approx(75.0), 75) and r.in_flight == 2 and r.num_waiting() == 0
    assert r.held_tokens(0.25) == 10 + 25 + 20 and r.outstanding_tokens(0.25) == 15 + 30
    assert r.remove_decode(3, 0.35) == (pytest.approx(20.0), 30)  # 10 generated since it was admitted


def _two_long_requests(migration):
    tr = Trace("two", np.array([0.0, 0.0]), np.array([100, 100]), np.array([2001, 2001]))
    svc = ServiceModel(0.0, 0.0, 0.01, 0.0, 8)  # a step is 10 ms whatever the batch
    pools = [SimPool("p", "prefill", svc, 1), SimPool("d", "decode", svc, 2, migration=migration)]
    sim = Simulation(tr, pools, slo=SLO, scaling=ShrinkAt("d", 5.0, 1), tick_s=1.0)
    return sim, sim.run()


def test_migrated_request_finishes_exactly_one_migration_later():
    """Equivalence with the plain path: two requests of 2,000 tokens at 10 ms a step, one per
    decode replica; at 5 s the pool shrinks to 1. Drained, the removed replica waits for its
    request (20 s); migrated, the request resumes on the other replica with the tokens it had to
    go (nothing recomputed, nothing lost) and finishes exactly one migration cost later than
    unmoved, and the replica leaves as its KV arrives."""
    m = MigrationModel(kv_bytes_per_token=1e6, bandwidth_bytes_per_s=1e9, pause_s=0.05)
    sim_d, drained = _two_long_requests(None)
    sim_m, migrated = _two_long_requests(m)
    end = drained.ttft + drained.tpot * 2000
    assert end == pytest.approx(drained.ttft + 20.0) and sim_d.completed == 2
    assert drained.migration.migrations == 0 and drained.migration.drain_s["d"][0] > 14  # waited for it
    assert migrated.migration.migrations == 1 and sim_m.completed == 2
    context = 100 + round((5.0 - migrated.ttft.max()) / 0.01)  # prompt + tokens generated by then
    cost = m.seconds(context)
    assert migrated.migration.bytes == pytest.approx(context * 1e6)
    delay = np.sort(migrated.ttft + migrated.tpot * 2000 - end)
    assert delay == SECONDS_FP64.approx([0.0, cost])  # the unmoved one: unchanged
    assert migrated.migration.drain_s["d"] == [pytest.approx(cost)]


@pytest.mark.parametrize("topology", ["disaggregated", "colocated"])
def test_scale_down_by_migration_under_load(topology):
    """A pool of 4 with long generations shrinks to 2 at 10 minutes: by migration the two removed
    replicas leave within seconds (their requests' KV over the link, one by one; a colocated
    replica's queued prompts go elsewhere, its running prefill finishes and then moves too), by
    draining only after their longest generation; every request completes exactly once either
    way, and the migrated run costs fewer replica-hours."""
    tr = synthetic_trace(duration_s=1200, base_rps=0.4, peak_rps=0.4, bursts_per_hour=0, mean_prompt=500,
                         mean_output=1500, seed=3)
    name = "d" if topology == "disaggregated" else "c"
    runs = {}
    for mode, mig in (("drain", None), ("migrate", MigrationModel())):
        pools = ([SimPool("p", "prefill", SVC, 1), SimPool("d", "decode", SVC, 4, migration=mig)]
                 if topology == "disaggregated" else [SimPool("c", "colocated", SVC, 4, migration=mig)])
        sim = Simulation(tr, pools, slo=SLO, scaling=ShrinkAt(name, 600.0, 2))
        runs[mode] = (sim, sim.run())
    for sim, res in runs.values():
        assert sim.completed == len(tr) and not np.isnan(res.tpot[tr.output > 1]).any()
        assert res.timeline[f"{name}.alive"][-1] == 2
    drained, migrated = runs["drain"][1], runs["migrate"][1]
    assert len(migrated.migration.drain_s[name]) == len(drained.migration.drain_s[name]) == 2
    assert max(migrated.migration.drain_s[name]) < 20 < max(drained.migration.drain_s[name])
    assert migrated.migration.migrations >= 4 and migrated.migration.bytes > 0
    assert migrated.replica_seconds[name] < drained.replica_seconds[name]


def test_rebalancer_moves_the_surplus_to_new_replicas_once():
    """Eight long generations on one decode replica; a second one is asked for at once and is up
    after 5 s. With the rebalancer the hot replica sends its surplus over the mean (4) to the new
    one at the next tick, the longest generations first, and nothing moves again (no bouncing):
    TPOT falls for every request and all complete exactly once."""
    n = 8
    tr = Trace("eight", np.zeros(n), np.full(n, 100), np.full(n, 3001))
    svc = ServiceModel(0.0, 0.0, 0.01, 0.004, 16)  # a step of 8 = 42 ms, of 4 = 26 ms
    runs = {}
    for rebalance in (False, True):
        pools = [SimPool("p", "prefill", svc, 1, startup_s=5.0),
                 SimPool("d", "decode", svc, 1, startup_s=5.0, migration=MigrationModel(), rebalance=rebalance)]
        sim = Simulation(tr, pools, slo=SLO, scaling=ShrinkAt("d", 0.0, 2), tick_s=1.0)
        runs[rebalance] = (sim, sim.run())
    (plain_sim, plain), (sim, moved) = runs[False], runs[True]
    assert plain_sim.completed == sim.completed == n
    assert plain.migration.migrations == 0 and moved.migration.migrations == moved.migration.rebalanced == n // 2
    assert moved.tpot.max() < plain.tpot.min()
    with pytest.raises(ValueError, match="needs a migration model"):
        SimPool("d", "decode", svc, 1, rebalance=True)
