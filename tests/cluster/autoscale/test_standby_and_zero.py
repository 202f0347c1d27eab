"""Steps 6 and 7 of the SLO autoscaler (cluster/autoscale/standby.py): standby replicas sized from the
burst risk (and their cost reported), decaying when no burst comes; a pool with min_replicas 0 going
to zero after its idle time, staying there while idle, and held at one while a request wakes it."""

from __future__ import annotations

import math

import pytest

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.slo import AutoscalerConfig, AutoscalerConfigError, AutoscalerState, PoolMetrics, PoolScaling, decide
from cluster.autoscale.profile import ReplicaCapacity, SLOTargets
from cluster.autoscale.standby import StandbyMemory, burst_risk, standby_count

CAP = ReplicaCapacity(requests_per_s=2.0, mean_prompt_tokens=100, mean_output_tokens=50)  # 100 output tok/s


def cfg(**pool_kw) -> AutoscalerConfig:
    pool = PoolScaling("main", "colocated", SLOTargets(ttft_p90_s=1.0, tpot_p90_s=0.05), CAP,
                       **{"min_replicas": 1, "max_replicas": 40, **pool_kw})
    return AutoscalerConfig(pools=(pool,), short_window_s=30.0, scale_to_zero_after_s=300.0, standby_memory_s=3600.0)


def metrics(rates: list[float], *, in_flight: float = 0.0, queue: float = 0.0) -> PoolMetrics:
    return PoolMetrics(bucket_s=10.0, arrivals_rps=rates, mean_prompt_tokens=100, mean_output_tokens=50,
                       in_flight=in_flight, queue_depth=queue)


def run(c: AutoscalerConfig, now: float, m: PoolMetrics, desired: int, state: AutoscalerState, *, standby: int = 0,
        starting: int = 0):
    st = PoolStatus("main", desired, desired - starting, starting, 0, standby=standby, standby_target=standby)
    decisions, state = decide(c, now, {"main": m}, {"main": st}, state)
    return decisions["main"], state


def test_burst_risk_is_a_decaying_maximum():
    assert burst_risk(StandbyMemory(), 0.0, 2.5, 3600) == 2.5
    mem = StandbyMemory(risk=4.0, risk_at=0.0)
    assert burst_risk(mem, 3600.0, 1.0, 3600) == pytest.approx(4.0 / math.e)  # one time constant later
    assert burst_risk(mem, 3600.0, 3.0, 3600) == 3.0  # a bigger rise than what is left wins
    assert standby_count(2.06, 4, to_zero=False) == 2 and standby_count(2.5, 4, to_zero=False) == 3
    assert standby_count(9.0, 4, to_zero=False) == 4 and standby_count(0.28, 4, to_zero=False) == 0
    assert standby_count(0.0, 4, to_zero=False) == 0 and standby_count(0.0, 4, to_zero=True) == 1
    assert standby_count(0.0, 0, to_zero=True) == 0  # none allowed: none kept


def test_standby_follows_the_bursts_seen_and_forgets_them():
    c, state = cfg(max_standby=6, standby_cost=0.25), AutoscalerState()
    flat = [4.0] * 30  # 4 req/s x 50 tok = 200 tok/s = 2 replicas' work: no burst, no standby
    d, state = run(c, 0.0, metrics(flat), 3, state)
    assert d.standby == 0 and d.standby_changed is False
    burst = [4.0] * 27 + [12.0] * 3  # the short window 8 req/s over the level: 8 x 50 / 100 = 4 replicas more
    d, state = run(c, 10.0, metrics(burst), 3, state)
    assert d.forecast_rps > 10 and d.standby is not None and 4 <= d.standby <= 6, d.reason
    assert "standby" in d.reason and "cost" in d.reason
    peak = d.standby
    d, state = run(c, 1810.0, metrics(flat), d.desired, state)  # half an hour of calm: e^-0.5 of the risk left
    assert 1 <= d.standby < peak, d.reason
    d, state = run(c, 4 * 3600.0, metrics(flat), d.desired, state)  # hours later: gone
    assert d.standby == 0


def test_max_standby_zero_leaves_the_count_alone():
    d, _ = run(cfg(), 0.0, metrics([4.0] * 27 + [12.0] * 3), 3, AutoscalerState(), standby=2)
    assert d.standby is None and not d.standby_changed


def test_an_idle_pool_goes_to_zero_and_stays_there_until_used():
    c, state = cfg(min_replicas=0, max_standby=2), AutoscalerState()
    d, state = run(c, 0.0, metrics([1.0] * 30, in_flight=1.0), 1, state)  # in use
    assert d.desired >= 1 and d.standby == 1  # a pool that scales to zero keeps a spare to wake from
    idle = metrics([1.0] * 29 + [0.0])
    d, state = run(c, 100.0, idle, d.desired, state)
    assert d.desired >= 1  # idle for 100 s only
    d, state = run(c, 301.0, metrics([0.0] * 30), d.desired, state)
    assert d.desired == 0 and "scale to zero" in d.reason
    d, state = run(c, 600.0, metrics([0.0] * 30), 0, state)
    assert d.desired == 0 and not d.changed  # asleep
    # a request arrived: the router woke the pool (desired 1, starting); the next round holds it at one
    d, state = run(c, 610.0, metrics([0.0] * 30, queue=1.0), 1, state, starting=1)
    assert d.desired == 1
    d, state = run(c, 620.0, metrics([0.0] * 29 + [0.1], in_flight=1.0), 1, state)
    assert d.desired == 1
    d, state = run(c, 900.0, metrics([0.0] * 30), 1, state)  # idle for 280 s after its last activity
    assert d.desired == 1
    d, state = run(c, 921.0, metrics([0.0] * 30), 1, state)
    assert d.desired == 0


def test_a_pool_with_min_replicas_one_never_goes_to_zero():
    c, state = cfg(), AutoscalerState()
    for t in range(0, 3600, 60):
        d, state = run(c, float(t), metrics([0.0] * 30), 1, state)
        assert d.desired == 1


def test_bad_standby_settings_are_refused():
    with pytest.raises(AutoscalerConfigError, match="max_standby"):
        cfg(max_standby=-1)
    with pytest.raises(AutoscalerConfigError, match="scale_to_zero_after_s"):
        AutoscalerConfig(pools=cfg().pools, scale_to_zero_after_s=-1)
