"""Drafter pools in the SLO autoscaler (cluster/autoscale/drafter.py, slo.py step 5): the real
decision function and the real live metrics provider over fake metric sources -- draft demand
follows the lead pool's plan, a pool whose drafting does not pay shrinks to its minimum, a
saturated one does not, and without draft metrics the prior ratio holds."""

from __future__ import annotations

import math

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.drafter import DraftWindow, demand_replicas, draft_speedup
from cluster.autoscale.metrics import PrometheusWindows
from cluster.autoscale.profile import ReplicaCapacity, SLOTargets
from cluster.autoscale.slo import (AutoscalerConfig, AutoscalerConfigError, AutoscalerState, PoolMetrics,
                                   PoolScaling, decide)
from testkit.tolerance import estimate

CAP = ReplicaCapacity(requests_per_s=2.0, mean_prompt_tokens=100, mean_output_tokens=50)
PAYS = DraftWindow(verifies=1000, draft_tokens=4000, accepted_tokens=1600, emitted_tokens=2600,
                   draft_wait_s=2.0, verify_s=8.0)  # E 2.6, k 4, wait 20%: 2.6 x 0.8 / 1.2 = 1.73x
NO_PAY = DraftWindow(verifies=1000, draft_tokens=4000, accepted_tokens=1600, emitted_tokens=2600,
                     draft_wait_s=6.0, verify_s=4.0)  # wait 60%: 0.87x


def config(**kw) -> AutoscalerConfig:
    drafter = dict(follows="decode", ratio=0.5, min_replicas=1, max_replicas=20, rows_per_replica=16.0,
                   verify_token_cost=0.05, headroom=0.1)
    drafter.update(kw.pop("drafter", {}))
    return AutoscalerConfig((PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=0.05), CAP, max_replicas=40),
                             PoolScaling("draft", "drafter", **drafter)), **kw)


def lead_window(rate: float) -> PoolMetrics:
    return PoolMetrics(bucket_s=10.0, arrivals_rps=[rate] * 6, mean_prompt_tokens=100, mean_output_tokens=50)


def run(cfg, metrics, sizes, now=0.0, state=None, ready=None):
    status = {p: PoolStatus(p, n, n if ready is None else ready.get(p, n), 0, 0) for p, n in sizes.items()}
    return decide(cfg, now, metrics, status, state or AutoscalerState())


def test_speedup_model_and_demand_match_the_worked_example():
    assert draft_speedup(PAYS, 0.05) == estimate(2.6 * 0.8 / 1.2, rel=1e-9, why="closed form")
    assert draft_speedup(NO_PAY, 0.05) == estimate(2.6 * 0.4 / 1.2, rel=1e-9, why="closed form")
    assert draft_speedup(DraftWindow(), 0.05) is None
    assert demand_replicas(40, 10, 12, 16, 0.1) == 4  # 48 rows x 1.1 / 16 = 3.3


def test_drafter_demand_follows_the_leads_planned_size():
    cfg = config()
    metrics = {"decode": lead_window(22.0), "draft": PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=40.0))}
    metrics["decode"] = PoolMetrics(**{**metrics["decode"].__dict__, "draft": PAYS})
    d, _ = run(cfg, metrics, {"decode": 10, "draft": 2})
    lead = d["decode"].desired
    assert lead > 10  # 22 req/s at 2 per replica, +10%: the lead grows
    assert d["draft"].desired == math.ceil(40 / 10 * lead * 1.1 / 16 - 1e-9)
    assert "speed-up 1.73x" in d["draft"].reason and "scale up 2 ->" in d["draft"].reason


def test_a_pool_whose_drafting_does_not_pay_shrinks_stepwise_to_its_minimum():
    cfg = config(down_interval_s=60.0, max_down_step_frac=0.2, drafter={"min_replicas": 2})
    lead = PoolMetrics(**{**lead_window(20.0).__dict__, "draft": NO_PAY})
    sizes, state, seen = {"decode": 11, "draft": 10}, AutoscalerState(), []
    for i in range(12):
        d, state = run(cfg, {"decode": lead, "draft": PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=20.0))},
                       sizes, now=1000.0 + 30.0 * i, state=state)
        sizes["draft"] = d["draft"].desired
        seen.append(sizes["draft"])
    assert "drafting does not pay" in d["draft"].reason
    assert seen[0] == 8 and seen[-1] == 2  # 10 - ceil(0.2 x 10), ... down to min_replicas
    assert all(b <= a for a, b in zip(seen, seen[1:]))
    assert seen[1] == 8  # one step per down_interval_s (60 s; rounds every 30 s)


def test_a_saturated_pool_is_not_shrunk_for_slow_rounds():
    cfg = config()
    lead = PoolMetrics(**{**lead_window(20.0).__dict__, "draft": NO_PAY})
    over = PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=3 * 16 + 10))  # more rows than 3 replicas batch
    d, _ = run(cfg, {"decode": lead, "draft": over}, {"decode": 11, "draft": 3})
    assert d["draft"].desired > 3 and "does not pay" not in d["draft"].reason


def test_benefit_needs_enough_verifies_to_be_judged():
    cfg = config(drafter={"min_verifies": 5000})
    lead = PoolMetrics(**{**lead_window(20.0).__dict__, "draft": NO_PAY})  # 1,000 verifies < 5,000
    d, _ = run(cfg, {"decode": lead, "draft": PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=20.0))},
               {"decode": 11, "draft": 2})
    assert d["draft"].desired == 2 and "speed-up" not in d["draft"].reason


def test_no_draft_metrics_holds_the_prior_ratio_and_says_so():
    cfg = config()
    d, _ = run(cfg, {"decode": lead_window(20.0), "draft": PoolMetrics(10.0, [0.0] * 6)}, {"decode": 11, "draft": 1})
    assert d["draft"].desired == math.ceil(0.5 * d["decode"].desired)
    assert "no draft metrics: prior ratio" in d["draft"].reason
    follow = config(drafter={"rows_per_replica": None})  # no demand scaling configured: follows by ratio
    d, _ = run(follow, {"decode": lead_window(20.0), "draft": PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=99))},
               {"decode": 11, "draft": 1})
    assert d["draft"].desired == math.ceil(0.5 * d["decode"].desired) and d["draft"].reason.startswith("follows")


@pytest.mark.parametrize("key, value, words", [("rows_per_replica", 0.0, "rows_per_replica"),
                                               ("min_speedup", -1.0, "min_speedup"),
                                               ("min_verifies", 0, "min_verifies")])
def test_bad_drafter_settings_name_the_key(key, value, words):
    with pytest.raises(AutoscalerConfigError, match=words):
        config(drafter={key: value})


# ---- the live provider: drafter and speculation counters relayed by two routers --------------------------------

def _source(rows: dict[str, float], compute: dict[str, float], spec: dict[str, dict[str, float]]):
    def collect():
        g = GaugeMetricFamily("duet_drafter_requests", "", labels=["pool", "drafter_id"])
        c = CounterMetricFamily("duet_drafter_compute_seconds", "", labels=["pool", "drafter_id"])
        for d, v in rows.items():
            g.add_metric(["draft", d], v)
        for d, v in compute.items():
            c.add_metric(["draft", d], v)
        fams = [g, c]
        for name in ("verifies", "draft_tokens", "accepted_tokens", "emitted_tokens", "draft_seconds", "verify_seconds"):
            f = CounterMetricFamily(f"duet_worker_spec_{name}", "", labels=["pool", "worker_id"])
            for w, vals in spec.items():
                f.add_metric(["decode", w], vals.get(name, 0.0))
            fams.append(f)
        return fams
    return collect


def test_prometheus_windows_read_draft_windows_per_replica_not_per_router():
    state = {"rows": {"d0": 3.0, "d1": 5.0}, "compute": {"d0": 0.0, "d1": 100.0},
             "spec": {"w0": {"verifies": 10, "draft_tokens": 40}, "w1": {"verifies": 0}}}
    src = lambda: _source(state["rows"], state["compute"], state["spec"])()  # noqa: E731 - reads the state now
    provider = PrometheusWindows([src, src], window_buckets=4, latency_buckets=1)  # two routers, same replicas
    assert provider.windows(["draft", "decode"], now=0.0) == {}
    state.update(rows={"d0": 4.0, "d1": 6.0}, compute={"d0": 5.0, "d1": 2.0},  # d1 restarted: counts from 0
                 spec={"w0": {"verifies": 110, "draft_tokens": 440, "accepted_tokens": 300, "emitted_tokens": 410,
                              "draft_seconds": 1.0, "verify_seconds": 4.0}, "w1": {"verifies": 50, "draft_tokens": 200}})
    w = provider.windows(["draft", "decode"], now=10.0)
    dw, sw = w["draft"].draft, w["decode"].draft
    assert dw is not None and sw is not None
    assert dw.rows == 10.0  # summed over replicas, not doubled by the two routers
    assert dw.busy == estimate(0.7, rel=1e-9, why="(5 + 2) s over 10 s")
    assert (sw.verifies, sw.draft_tokens, sw.accepted_tokens, sw.emitted_tokens) == (150, 600, 300, 410)
    assert (sw.draft_wait_s, sw.verify_s) == (1.0, 4.0)


def test_a_pool_without_drafting_samples_has_no_draft_window():
    provider = PrometheusWindows([lambda: []], window_buckets=2, latency_buckets=1)
    provider.windows(["decode"], now=0.0)
    assert provider.windows(["decode"], now=10.0)["decode"].draft is None


def test_the_router_exporters_names_are_the_ones_read():
    """Over the router's real exporter (router/prometheus.py), through the text format a scrape
    returns: a drafter replica's DrafterLoad and a target's LoadReport land in the draft windows."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from protos.duet.drafter.v1 import drafter_pb2
    from protos.duet.worker.v1 import worker_pb2
    from router.prometheus import metrics_registry

    state = {"compute": 0.0, "verifies": 0}

    def snapshot():
        d = drafter_pb2.DrafterLoad(num_requests=7, compute_seconds=state["compute"])
        w = worker_pb2.LoadReport(spec_verifies=state["verifies"], spec_draft_tokens=4 * state["verifies"],
                                  spec_accepted_tokens=3 * state["verifies"], spec_emitted_tokens=4 * state["verifies"],
                                  spec_draft_seconds=0.01 * state["verifies"], spec_verify_seconds=0.04 * state["verifies"])
        return {"requests": {}, "admission": {"in_flight": 0, "queued": 0, "max_in_flight": 1, "max_queue": 1,
                                              "admitted": 0, "rejected": 0},
                "policy": {}, "workers": [], "worker_stream_failures": 0, "load_reports": [("w0", "decode", w)],
                "drafter_reports": [("d0", "draft", d)]}
    registry = metrics_registry(snapshot)
    scrape = lambda: list(text_string_to_metric_families(generate_latest(registry).decode()))  # noqa: E731
    provider = PrometheusWindows([scrape], window_buckets=2, latency_buckets=1)
    provider.windows(["draft", "decode"], now=0.0)
    state.update(compute=4.0, verifies=100)
    w = provider.windows(["draft", "decode"], now=10.0)
    assert w["draft"].draft.rows == 7 and w["draft"].draft.busy == estimate(0.4, rel=1e-9, why="4 s over 10 s")
    spec = w["decode"].draft
    assert (spec.verifies, spec.draft_tokens, spec.accepted_tokens, spec.emitted_tokens) == (100, 400, 300, 400)
    assert draft_speedup(spec, 0.0) == estimate(4 * 0.8, rel=1e-9, why="E 4, wait 1 s of 5 s: closed form")


def test_requests_that_found_no_room_count_as_demand():
    cfg = config()
    lead = PoolMetrics(**{**lead_window(20.0).__dict__, "draft": PAYS})
    held = PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=32.0))  # 2 full replicas at 16 rows
    more = PoolMetrics(10.0, [0.0] * 6, draft=DraftWindow(rows=32.0, unserved=32.0))  # as many more found none
    d_held, _ = run(cfg, {"decode": lead, "draft": held}, {"decode": 11, "draft": 2})
    d_more, _ = run(cfg, {"decode": lead, "draft": more}, {"decode": 11, "draft": 2})
    lead_n = d_more["decode"].desired
    assert d_more["draft"].desired == math.ceil(64 / 11 * lead_n * 1.1 / 16 - 1e-9) > d_held["draft"].desired
    assert "32.0 unserved" in d_more["draft"].reason
