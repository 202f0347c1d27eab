"""The sim-vs-real comparison logic (benchmarks/sim_vs_real.py) on hand-made records: the real
side's definitions, the trace the simulator replays, the simulator fed a service model reproducing
its own arithmetic, and the pass rule (relative error, absolute floor, the real p90's bootstrap
interval)."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.sim_vs_real import Tolerance, bootstrap_p90, compare, real_latencies, simulate, trace_from_records
from cluster.autoscale.profile import ServiceModel, SLOTargets

SVC = ServiceModel(prefill_base_s=0.05, prefill_per_token_s=0.001, decode_base_s=0.02, decode_per_seq_s=0.005)


def _record(send: float, ttft: float, tpot: float, n: int, prompt: int, error: str | None = None) -> dict:
    times = [send + ttft + i * tpot for i in range(n)]
    return {"send": send, "chunk_times": [] if error else times, "chunk_tokens": [] if error else [1] * n,
            "prompt_tokens": prompt, "error": error}


def test_trace_and_real_latencies_follow_the_records():
    records = [_record(12.0, 0.2, 0.03, 5, 40), _record(10.0, 0.1, 0.02, 3, 20),
               _record(11.0, 0.0, 0.0, 0, 30, error="UNAVAILABLE: gone")]
    trace = trace_from_records(records)
    assert trace.t.tolist() == [0.0, 2.0] and trace.prompt.tolist() == [20, 40] and trace.output.tolist() == [3, 5]
    lat = real_latencies(records)
    assert lat["ttft"] == pytest.approx([0.2, 0.1]) and lat["tpot"] == pytest.approx([0.03, 0.02])


def test_simulate_reproduces_the_service_model_on_an_idle_replica():
    # Two requests far apart: each sees an idle replica, so TTFT = a + b P and TPOT = c + d (batch of 1).
    trace = trace_from_records([_record(0.0, 0.1, 0.02, 9, 100), _record(100.0, 0.1, 0.02, 5, 300)])
    sim = simulate(trace, SVC, SLOTargets(1.0, 0.1))
    assert sim["ttft"] == pytest.approx([0.05 + 0.1, 0.05 + 0.3])
    assert sim["tpot"] == pytest.approx([0.025, 0.025])


def test_compare_passes_a_faithful_model_and_fails_a_wrong_one():
    rng = random.Random(0)
    real = {"ttft": [rng.uniform(0.1, 0.3) for _ in range(40)], "tpot": [rng.uniform(0.02, 0.04) for _ in range(40)]}
    same = compare(real, real, Tolerance())
    assert same["ok"] and same["ttft"]["rel_error"] == 0.0 and same["ttft"]["samples"] == 40
    double = compare(real, {k: [2 * x for x in v] for k, v in real.items()}, Tolerance())
    assert not double["ok"] and not double["ttft"]["ok"] and double["ttft"]["rel_error"] == pytest.approx(1.0)
    # 20% off passes at the default 25% (and fails at 10%, where this sample's interval is narrower).
    off = {k: [1.2 * x for x in v] for k, v in real.items()}
    assert compare(real, off, Tolerance())["ok"]
    assert not compare(real, off, Tolerance(rel=0.1, ttft_floor_s=0.0, tpot_floor_s=0.0))["ok"]


def test_absolute_floor_and_bootstrap_interval_widen_the_allowance():
    tiny = {"ttft": [0.010] * 30, "tpot": [0.001] * 30}
    assert compare(tiny, {"ttft": [0.025] * 30, "tpot": [0.003] * 30}, Tolerance())["ok"]  # within the floors
    # A noisy real sample: the p90's own interval is wider than 25%, and bounds the allowance.
    noisy = {"ttft": [0.1] * 25 + [0.5, 1.0, 2.0, 3.0, 4.0], "tpot": [0.02] * 30}
    lo, hi = bootstrap_p90(noisy["ttft"], 0.9, 2000)
    assert hi - lo > 0.5 * 2 * 0.25 * 1.0
    row = compare(noisy, {"ttft": [x * 1.5 for x in noisy["ttft"]], "tpot": noisy["tpot"]}, Tolerance())
    assert row["ttft"]["allowed_s"] == pytest.approx((hi - lo) / 2) and row["ttft"]["ok"]


def test_no_samples_is_a_failure_not_a_pass():
    row = compare({"ttft": [], "tpot": []}, {"ttft": [0.1], "tpot": [0.01]}, Tolerance())
    assert not row["ok"] and math.isnan(row["ttft"]["real_p90_s"])
