"""cluster/bench/metrics.py: the metric definitions on hand-computed timings."""

from __future__ import annotations

import math

import pytest

from cluster.bench.load_gen import build_workload, poisson_arrivals
from cluster.bench.metrics import SLO, RequestRecord, percentile, summarize

from testkit.tolerance import estimate


def test_per_request_definitions():
    r = RequestRecord(send=1.0, chunk_times=[1.05, 1.07, 1.10, 1.11], chunk_tokens=[1, 1, 2, 1], prompt_tokens=10)
    assert r.ok and r.output_tokens == 5
    assert r.ttft == pytest.approx(0.05) and r.e2e == pytest.approx(0.11)
    assert r.tpot == pytest.approx((0.11 - 0.05) / 4)  # (E2E - TTFT) / (n - 1), per token not per chunk
    assert r.itls == pytest.approx([0.02, 0.03, 0.01])  # one gap per chunk
    single = RequestRecord(send=0.0, chunk_times=[0.2], chunk_tokens=[1])
    assert single.tpot is None and single.itls == []
    assert not RequestRecord(send=0.0, error="UNAVAILABLE: gone").ok


def test_percentiles_interpolate_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))


def test_summary_throughput_and_goodput():
    fast = RequestRecord(send=0.0, chunk_times=[0.1, 0.2, 0.3], chunk_tokens=[1, 1, 1], prompt_tokens=5)
    slow_first = RequestRecord(send=0.5, chunk_times=[1.5, 1.6], chunk_tokens=[1, 1], prompt_tokens=7)  # TTFT 1 s
    slow_tokens = RequestRecord(send=1.0, chunk_times=[1.1, 2.0], chunk_tokens=[1, 1], prompt_tokens=3)  # TPOT 0.9 s
    failed = RequestRecord(send=1.5, error="RESOURCE_EXHAUSTED: router overloaded")
    s = summarize([fast, slow_first, slow_tokens, failed], SLO(ttft_s=0.5, tpot_s=0.5))
    assert (s["num_requests"], s["completed"], s["errors"]) == (4, 3, {"RESOURCE_EXHAUSTED": 1})
    assert s["duration_s"] == pytest.approx(2.0)  # first send 0.0 -> last token 2.0
    assert s["request_throughput_rps"] == pytest.approx(1.5)
    assert s["output_throughput_tps"] == pytest.approx(7 / 2.0)
    assert s["total_token_throughput_tps"] == pytest.approx((7 + 15) / 2.0)
    assert s["goodput_rps"] == pytest.approx(0.5)  # only `fast` meets both SLOs
    assert s["ttft"]["p50_ms"] == pytest.approx(100.0)
    assert s["e2e"]["p50_ms"] == pytest.approx(1000.0)


def test_workload_is_deterministic_and_arrivals_are_poisson(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    a = build_workload(tok, 20, seed=3, min_output=4, max_output=9)
    assert a == build_workload(tok, 20, seed=3, min_output=4, max_output=9)
    assert a != build_workload(tok, 20, seed=4, min_output=4, max_output=9)
    assert all(4 <= r.max_tokens <= 9 for r in a) and len({r.max_tokens for r in a}) > 1
    r = a[0]  # ids are what the router makes of a chat request
    templated = tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True,
                                        tokenize=False)
    assert list(r.prompt_ids) == tok.encode(templated, add_special_tokens=False)
    t = poisson_arrivals(4000, 8.0, seed=1)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    assert all(g >= 0 for g in gaps) and sum(gaps) / len(gaps) == estimate(1 / 8.0, rel=0.05,
                                                                          why="mean of 4000 exponential gaps: sd 1.6%")
    assert poisson_arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="min_output"):
        build_workload(tok, 1, seed=0, min_output=5, max_output=4)
