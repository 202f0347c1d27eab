"""Arrival traces: the seeded synthetic generator and the BurstGPT / Azure CSV readers."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.sim.trace import TraceError, read_azure, read_burstgpt, synthetic_trace

from testkit.tolerance import estimate


def test_synthetic_is_seeded_and_follows_the_diurnal_rate():
    a = synthetic_trace(duration_s=86400, base_rps=1, peak_rps=9, bursts_per_hour=0, seed=3, mean_output=100)
    b = synthetic_trace(duration_s=86400, base_rps=1, peak_rps=9, bursts_per_hour=0, seed=3, mean_output=100)
    c = synthetic_trace(duration_s=86400, base_rps=1, peak_rps=9, bursts_per_hour=0, seed=4, mean_output=100)
    assert np.array_equal(a.t, b.t) and np.array_equal(a.output, b.output) and not np.array_equal(a.t[:50], c.t[:50])
    hourly = a.rate_series(3600.0)
    # Peak at 14:00 (9/s), trough at 02:00 (1/s); mean rate = (1 + 9) / 2 = 5/s. Poisson counts over an
    # hour at 9/s have sd sqrt(32400)/3600 = 0.05/s: 0.5/s tolerances are ~10 sd (+ the hour's curvature).
    poisson = "~10 sd of an hour's Poisson count, plus the hour's curvature (above)"
    assert hourly[14] == estimate(9.0, abs=0.5, why=poisson) and hourly[2] == estimate(1.0, abs=0.5, why=poisson)
    assert len(a) / 86400 == estimate(5.0, rel=0.02, why="432k Poisson arrivals: sd 0.15%, ~13 sd")
    assert a.output.mean() == estimate(100, rel=0.05, why="mean of 432k sampled lengths: well inside 5%") and a.output.min() >= 1


def test_bursts_raise_the_rate():
    flat = synthetic_trace(duration_s=7200, base_rps=5, peak_rps=5, bursts_per_hour=0, seed=1)
    bursty = synthetic_trace(duration_s=7200, base_rps=5, peak_rps=5, bursts_per_hour=6, burst_factor=3,
                             burst_mean_s=120, seed=1)
    assert len(bursty) > 1.1 * len(flat)
    assert bursty.rate_series(60.0).max() >= 12  # some minute ran at ~3x
    assert flat.rate_series(60.0).max() < 10


def test_bad_generator_arguments():
    with pytest.raises(ValueError, match="base_rps"):
        synthetic_trace(duration_s=10, base_rps=5, peak_rps=1)


def test_read_burstgpt(tmp_path):
    f = tmp_path / "BurstGPT_sample.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n"
                 "0,ChatGPT,1012,0,1012,Conversation log\n"
                 "2.5,GPT-4,120,300,420,API log\n")
    tr = read_burstgpt(f)
    assert list(tr.t) == [0.0, 2.5] and list(tr.prompt) == [120, 472] and list(tr.output) == [300, 18]
    assert tr.name == "BurstGPT_sample"


def test_read_azure(tmp_path):
    f = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:15:46.1805900,879,20\n")
    tr = read_azure(f)
    assert tr.t == pytest.approx([0.0, 0.5, 4.814579])
    assert list(tr.prompt) == [879, 374, 396] and list(tr.output) == [20, 44, 109]


def test_reader_errors_name_file_row_and_column(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n")
    with pytest.raises(TraceError, match=r"missing column.*GeneratedTokens"):
        read_azure(f)
    f.write_text("Timestamp,Request tokens,Response tokens\n1,abc,3\n")
    with pytest.raises(TraceError, match=r"bad.csv:2: Request tokens='abc'"):
        read_burstgpt(f)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(TraceError, match="TIMESTAMP='yesterday'"):
        read_azure(f)
    with pytest.raises(TraceError, match="no such trace file"):
        read_azure(tmp_path / "missing.csv")


def test_slice_and_rate_series():
    tr = synthetic_trace(duration_s=600, base_rps=2, peak_rps=2, bursts_per_hour=0, seed=0)
    part = tr.slice(100, 200)
    assert part.t.min() >= 0 and part.t.max() < 100
    assert len(part) == int(((tr.t >= 100) & (tr.t < 200)).sum())
    assert tr.rate_series(60.0).sum() * 60.0 == pytest.approx(len(tr))


def test_shapes_fixed_bursts_and_pareto_lengths():
    kw = dict(duration_s=7200, base_rps=2, peak_rps=8, period_s=1800, peak_at_s=0, bursts_per_hour=0, seed=4)
    saw = synthetic_trace(shape="sawtooth", **kw).rate_series(300.0)  # 6 buckets per 30-min ramp
    counts = "a 300-450 s bucket's Poisson count at 2-8/s: sd 0.07-0.16/s, ~4-5 sd"
    assert saw[0] == estimate(2 + 6 * 0.5 / 6, abs=0.6, why=counts) and saw[5] == estimate(2 + 6 * 5.5 / 6, abs=0.8,
                                                                                         why=counts)
    assert saw[6] < saw[5] - 3  # the instant drop at the period's end
    onoff = synthetic_trace(shape="on_off", duty=0.25, **kw).rate_series(450.0)  # on for the first 450 s of 1800
    assert onoff[0] == estimate(8, abs=0.6, why=counts) and all(x == estimate(2, abs=0.4, why=counts) for x in onoff[1:4])
    step = synthetic_trace(duration_s=3600, base_rps=5, peak_rps=5, bursts_per_hour=0, bursts=((1200, 600, 4.0),),
                           seed=2)
    r = step.rate_series(600.0)
    assert r[2] == estimate(20, rel=0.1, why="600 s at 20/s: Poisson sd 1.3%, ~8 sd")
    five = "600 s at 5/s: Poisson sd 2.6%, ~6 sd"
    assert r[1] == estimate(5, rel=0.15, why=five) and r[3] == estimate(5, rel=0.15, why=five)
    heavy = synthetic_trace(duration_s=3600, base_rps=20, peak_rps=20, bursts_per_hour=0, lengths="pareto",
                            tail_alpha=1.5, mean_output=1000, max_output=1 << 20, seed=3)
    light = synthetic_trace(duration_s=3600, base_rps=20, peak_rps=20, bursts_per_hour=0, mean_output=1000, cv=1.0,
                            max_output=1 << 20, seed=3)
    assert heavy.output.min() >= 333  # Pareto I's scale: mean (alpha - 1) / alpha
    assert np.percentile(heavy.output, 99.9) > 2 * np.percentile(light.output, 99.9)  # the heavier tail


def test_piecewise_shape_interpolates_its_knots():
    tr = synthetic_trace(duration_s=7200, base_rps=2, peak_rps=10, shape="piecewise", bursts_per_hour=0, seed=5,
                         knots=((1800, 0.0), (3600, 1.0), (5400, 0.5)))
    r = tr.rate_series(600.0)  # flat 2 before the first knot, a ramp to 10, down to 6, flat after the last
    counts = "a 600 s bucket's Poisson count at 2-10/s: sd 0.06-0.13/s, ~5 sd"
    assert all(x == estimate(2, abs=0.35, why=counts) for x in r[:3])
    assert r[3] == estimate(2 + 8 * 1 / 6, abs=0.5, why=counts) and r[5] == estimate(2 + 8 * 5 / 6, abs=0.6, why=counts)
    assert r[6] == estimate(10 - 4 * 1 / 6, abs=0.6, why=counts) and all(x == estimate(6, abs=0.5, why=counts)
                                                                   for x in r[9:])


def test_random_bursts_of_varying_size():
    kw = dict(duration_s=36000, base_rps=10, peak_rps=10, bursts_per_hour=1, burst_mean_s=600, seed=7)
    fixed = synthetic_trace(burst_factor=2.0, **kw)
    varied = synthetic_trace(burst_factor=1.5, burst_factor_max=3.0, **kw)
    assert synthetic_trace(burst_factor=2.0, burst_factor_max=None, **kw).t.tobytes() == fixed.t.tobytes()
    # Minutes inside a burst, as a factor over the base: spread over [1.5, 3] (overlaps multiply).
    peaks = np.asarray([x / 10 for x in varied.rate_series(60.0) if x > 13])
    assert np.mean(peaks < 1.7) > 0.15 and np.mean((peaks > 2.5) & (peaks < 3.1)) > 0.1
    fixed_peaks = np.asarray([x / 10 for x in fixed.rate_series(60.0) if x > 13])
    assert np.mean(fixed_peaks < 1.7) < 0.1 and np.mean((fixed_peaks > 2.5) & (fixed_peaks < 3.1)) < 0.05


@pytest.mark.parametrize("kw, message", [
    ({"shape": "square"}, "shape='square'"),
    ({"duty": 0.0}, "duty=0.0"),
    ({"lengths": "zipf"}, "lengths='zipf'"),
    ({"lengths": "pareto", "tail_alpha": 1.0}, "tail_alpha=1.0"),
    ({"bursts": ((0, 0, 2.0),)}, r"bursts\[0\]"),
    ({"shape": "piecewise"}, "knots=()"),
    ({"shape": "piecewise", "knots": ((0, 0), (0, 1))}, "strictly increasing"),
    ({"shape": "piecewise", "knots": ((0, 0), (10, 1.5))}, "knots="),
    ({"burst_factor": 2.0, "burst_factor_max": 1.5}, "burst_factor_max=1.5"),
])
def test_bad_generator_arguments_name_the_argument(kw, message):
    with pytest.raises(ValueError, match=message):
        synthetic_trace(duration_s=60, base_rps=1, peak_rps=1, **kw)
