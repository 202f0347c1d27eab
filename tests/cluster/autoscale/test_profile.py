"""Capacity profiles: file format, validation, and building a profile from measured rate steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.cli import main as duet_main
from cluster.autoscale.profile import (
    Profile,
    ProfileError,
    ReplicaCapacity,
    ServiceModel,
    SLOTargets,
    load_profile,
    profile_to_dict,
    save_profile,
)
from cluster.bench.profiler import fit_service, profile_from_rates

from testkit.tolerance import SECONDS_FP64, estimate

PROFILE = Profile(model="SmolLM2-135M-Instruct", pool_type="colocated", slo=SLOTargets(0.5, 0.05),
                  capacity=ReplicaCapacity(1.6, 45.0, 64.0),
                  service=ServiceModel(0.01, 0.0004, 0.012, 0.002, 64), machine={"cpus": 2})


def test_round_trip(tmp_path):
    path = save_profile(PROFILE, tmp_path / "p" / "colocated.json")
    assert load_profile(path) == PROFILE
    d = json.loads(path.read_text())
    assert d["format"] == "duet-profile/1" and d["capacity"]["output_tokens_per_s"] == pytest.approx(102.4)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(pool_type="gpu"), "pool_type='gpu'"),
    (lambda d: d["capacity"].update(requests_per_s=0), "capacity.requests_per_s=0"),
    (lambda d: d["slo"].update(tpot_p90_s=None), "slo.tpot_p90_s"),
    (lambda d: d["slo"].update(ttft_p90_s=-1), "slo.ttft_p90_s=-1"),
    (lambda d: d["capacity"].update(rps=1), "unknown keys \\['rps'\\]"),
    (lambda d: d.pop("model"), "missing key 'model'"),
    (lambda d: d.update(format="v0"), "format='v0'"),
    (lambda d: d["service"].update(max_batch=0), "service.max_batch=0"),
])
def test_validation_names_the_key(tmp_path, edit, match):
    d = profile_to_dict(PROFILE)
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=match):
        load_profile(path)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ProfileError, match="duet profile --out"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(tmp_path / "x.json")


def _step(rate, ttft_p90_ms, tpot_p90_ms, rng, *, batch=1.0, a=0.02, b=0.001, c=0.01, d=0.002):
    """A serving_bench rate result whose raw records follow prefill a + b P and decode c + d B, with
    the throughput that makes B the mean decode batch (Little: B = throughput x decode time) and the
    TPOT a colocated replica shows: the step stretched by the prefills it stalls for, step / (1 - rho),
    rho = throughput x prefill time of the mean prompt (solved together with the throughput)."""
    n = 16
    prompts = [int(rng.integers(20, 80)) for _ in range(20)]
    prefill = a + b * float(np.mean(prompts))
    k = batch * prefill / ((n - 1) * (c + d * batch))
    rho = k / (1 + k)  # rho = rps x prefill with rps = batch (1 - rho) / ((n - 1) step)
    step = (c + d * batch) / (1 - rho)
    raw = [{"send": 0.0, "prompt_tokens": p, "chunk_tokens": [1] * n,
            "chunk_times": [a + b * p + j * step for j in range(n)], "error": None} for p in prompts]
    rps = batch / ((n - 1) * step)
    return {"path": "router", "rate": rate, "completed": 20, "num_requests": 20, "request_throughput_rps": rps,
            "output_throughput_tps": rps * n, "ttft": {"p90_ms": ttft_p90_ms},
            "tpot": {"p50_ms": step * 1e3, "p90_ms": tpot_p90_ms}, "raw": raw}


def test_profile_from_rates_picks_the_best_rate_within_slo_and_fits_the_service():
    rng = np.random.default_rng(0)
    steps = [_step(0.5, 100, 12, rng, batch=1.0), _step(1, 150, 14, rng, batch=2.0),
             _step(2, 300, 40, rng, batch=4.0), _step(4, 2000, 90, rng, batch=6.0)]  # the last misses both SLOs
    p = profile_from_rates("m", SLOTargets(0.5, 0.05), steps, {"cpus": 2}, 64)
    assert p.capacity.requests_per_s == pytest.approx(steps[2]["request_throughput_rps"])
    assert p.measured["capacity_rate"] == 2 and p.capacity.mean_output_tokens == 16
    svc = p.service
    assert svc.prefill_base_s == SECONDS_FP64.approx(0.02) and svc.prefill_per_token_s == pytest.approx(0.001)
    fit = "the fit undoes the prefill stalls' stretch of the step (step / (1 - rho)) from measured rates"
    assert svc.decode_base_s == estimate(0.01, rel=0.01, why=fit) and svc.decode_per_seq_s == estimate(0.002, rel=0.01,
                                                                                                        why=fit)


def test_profile_from_rates_when_nothing_meets_the_slo():
    rng = np.random.default_rng(0)
    with pytest.raises(ProfileError, match="relax"):
        profile_from_rates("m", SLOTargets(0.05, 0.005), [_step(1, 900, 40, rng)], {}, 64)


def test_fit_service_single_rate():
    rng = np.random.default_rng(1)
    svc = fit_service([_step(1, 100, 12, rng)], 8)
    assert svc.decode_per_seq_s == 0.0 and svc.decode_base_s == pytest.approx(0.012) and svc.max_batch == 8


def test_cli_has_profile(capsys):
    with pytest.raises(SystemExit) as e:
        duet_main(["profile", "--help"])
    assert e.value.code == 0 and "--slo-tpot-ms" in capsys.readouterr().out


def test_fit_service_falls_back_to_the_median_when_prompts_are_alike():
    rng = np.random.default_rng(2)
    step = _step(1, 100, 12, rng)
    for i, rec in enumerate(step["raw"]):  # two prompt lengths, TTFT noise unrelated to them
        rec["prompt_tokens"] = 40 + i % 2
        shift = 0.05 if i % 2 == 0 else 0.0
        rec["chunk_times"] = [t + shift for t in rec["chunk_times"]]
    svc = fit_service([step], 8)
    ttfts = [rec["chunk_times"][0] - rec["send"] for rec in step["raw"]]
    assert svc.prefill_per_token_s == 0.0 and svc.prefill_base_s == pytest.approx(float(np.median(ttfts)))
