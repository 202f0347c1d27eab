"""Simulator add-ons: capacity profiling in simulation, the hindsight oracle, the PNG timeline.

capacity in simulation (``sim_capacity``): what ``duet profile`` measures on a real replica,
measured on one simulated replica instead: bisect the Poisson arrival rate until the p90 TTFT
(prefill, colocated) and p90 TPOT (decode, colocated) of ``requests`` requests just meet the SLOs.
The other stage of a disaggregated pair is given ample capacity so only the profiled one limits.
It also returns the mean requests in flight at that rate (Little's law: rate x mean time in the
pool), the natural ``target_ongoing_requests`` for the queue-length baseline.

The hindsight oracle (``oracle_schedule``): for each interval of ``interval_s``, the fewest replicas
per pool that carry the interval's realised load at the profiled capacity, without headroom --
``ceil(work_replicas(realised rate, realised token means))`` (the autoscaler's own capacity model,
cluster/autoscale/slo.py), at least ``min_replicas``. It knows the future and starts replicas
instantly: replica-hours no online policy can beat, given the capacity model. ``OracleScaling``
plays that schedule through the simulator (asking ``lead_s`` early so replicas are up in time),
which checks whether the oracle sizes do meet the SLO.

Example::

    cap, in_flight = sim_capacity(svc, "decode", SLOTargets(tpot_p90_s=0.05), mean_prompt=512, mean_output=256)
    sizes, hours = oracle_schedule(trace, scaling_config, interval_s=300)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.slo import AutoscalerConfig, Decision, PoolMetrics, work_replicas
from cluster.autoscale.profile import ReplicaCapacity, ServiceModel, SLOTargets
from cluster.sim.trace import Trace, synthetic_trace
from cluster.sim.pool import SimPool
from cluster.sim.simulator import Simulation


def sim_capacity(svc: ServiceModel, role: str, slo: SLOTargets, *, mean_prompt: float, mean_output: float,
                 cv: float = 1.0, requests: int = 4000, seed: int = 0, iters: int = 12,
                 quantile: float = 90.0) -> tuple[ReplicaCapacity, float]:
    """(capacity at the SLOs, mean requests in flight at that rate) of one simulated replica.
    quantile: the latency percentile that must meet the SLO (90 = the p90 SLOs; 99 for a target of
    99% of requests within the SLO)."""
    # A rate surely too high: one replica cannot exceed its unloaded service rate on either stage.
    prefill_rate = 1.0 / svc.prefill_s(round(mean_prompt))
    decode_rate = svc.max_batch / (svc.decode_step_s(svc.max_batch) * max(mean_output - 1, 1))
    hi = {"prefill": prefill_rate, "decode": decode_rate, "colocated": min(prefill_rate, decode_rate)}[role] * 1.5
    lo = 0.0
    best = None
    for _ in range(iters):
        rate = (lo + hi) / 2
        ok, in_flight = _meets(svc, role, slo, rate, mean_prompt, mean_output, cv, requests, seed, quantile)
        if ok:
            lo, best = rate, in_flight
        else:
            hi = rate
    if best is None:
        raise ValueError(f"{role} replica: the SLOs {slo} are not met even at {hi:.3g} req/s; relax them")
    return ReplicaCapacity(lo, mean_prompt, mean_output), best


def _meets(svc: ServiceModel, role: str, slo: SLOTargets, rate: float, mean_prompt: float, mean_output: float,
           cv: float, requests: int, seed: int, quantile: float) -> tuple[bool, float]:
    duration = requests / rate
    tr = synthetic_trace(duration_s=duration, base_rps=rate, peak_rps=rate, bursts_per_hour=0, mean_prompt=mean_prompt,
                         mean_output=mean_output, cv=cv, seed=seed)
    ample = ServiceModel(0.0, 0.0, 1e-6, 0.0, 1 << 20)  # the stage not being profiled: never the bottleneck
    if role == "colocated":
        pools = [SimPool("main", "colocated", svc, 1)]
    elif role == "prefill":
        pools = [SimPool("p", "prefill", svc, 1), SimPool("d", "decode", ample, 1)]
    else:
        pools = [SimPool("p", "prefill", ample, 1), SimPool("d", "decode", svc, 1)]
    res = Simulation(tr, pools, slo=slo, seed=seed).run()
    ok = True
    if role in ("prefill", "colocated"):
        ok &= float(np.percentile(res.ttft, quantile)) <= slo.ttft_p90_s  # type: ignore[operator]
    if role in ("decode", "colocated"):
        tpot = res.tpot[~np.isnan(res.tpot)]
        ok &= float(np.percentile(tpot, quantile)) <= slo.tpot_p90_s  # type: ignore[operator]
    e2e = res.ttft + np.nan_to_num(res.tpot) * np.maximum(tr.output - 1, 0)
    in_pool = {"prefill": res.ttft, "decode": e2e - res.ttft, "colocated": e2e}[role]
    return bool(ok), float(rate * np.mean(in_pool))


def oracle_schedule(trace: Trace, config: AutoscalerConfig, interval_s: float) -> tuple[dict[str, np.ndarray], float]:
    """({pool: replicas per interval}, replica-hours) of the hindsight oracle (module docstring)."""
    n = max(1, math.ceil(trace.duration_s / interval_s + 1e-9))
    idx = (trace.t // interval_s).astype(np.int64)
    count = np.bincount(idx, minlength=n)[:n]
    psum = np.bincount(idx, weights=trace.prompt, minlength=n)[:n]
    osum = np.bincount(idx, weights=trace.output, minlength=n)[:n]
    sizes: dict[str, np.ndarray] = {}
    for p in config.pools:
        if p.role == "drafter":
            continue
        out = np.empty(n, dtype=np.int64)
        for k in range(n):
            c = count[k]
            m = PoolMetrics(interval_s, (), psum[k] / c if c else 0.0, osum[k] / c if c else 0.0)
            need = math.ceil(work_replicas(p, m, c / interval_s) - 1e-9) if c else 0
            out[k] = max(p.min_replicas, min(p.max_replicas, need))
        sizes[p.pool] = out
    hours = sum(float(s.sum()) for s in sizes.values()) * interval_s / 3600.0
    return sizes, hours


class OracleScaling:
    """ScalingPolicy that plays an oracle schedule, asking ``lead_s`` ahead (replica start time)."""

    def __init__(self, sizes: Mapping[str, np.ndarray], interval_s: float, lead_s: float) -> None:
        self.sizes, self.interval_s, self.lead_s = sizes, interval_s, lead_s
        self.pools = tuple(sizes)

    def decide(self, now: float, metrics: Mapping[str, PoolMetrics],
               status: Mapping[str, PoolStatus]) -> dict[str, Decision]:
        out = {}
        for pool, s in self.sizes.items():
            k0 = int(now // self.interval_s)
            k1 = int((now + self.lead_s) // self.interval_s)
            want = int(max(s[min(k, len(s) - 1)] for k in range(k0, k1 + 1)))  # cover now through the lead
            out[pool] = Decision(pool, status[pool].desired, want, "oracle")
        return out


def plot_timeline(runs: Mapping[str, object], path: Path, *, oracle: Mapping[str, np.ndarray] | None = None,
                  oracle_interval_s: float = 300.0, slo: SLOTargets | None = None) -> Path:
    """One PNG: arrival rate, replicas per pool per run (and the oracle), p90 TTFT and TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    first = next(iter(runs.values()))
    t = np.asarray(first.timeline["t"]) / 3600.0  # type: ignore[attr-defined]
    ax[0].plot(t, first.timeline["arrival_rps"], lw=0.5, color="gray")  # type: ignore[attr-defined]
    ax[0].set_ylabel("arrivals (req/s)")
    for name, res in runs.items():
        tl = res.timeline  # type: ignore[attr-defined]
        total = np.sum([tl[k] for k in tl if k.endswith(".alive")], axis=0)
        ax[1].plot(np.asarray(tl["t"]) / 3600.0, total, lw=0.8, label=name)
        ax[2].plot(np.asarray(tl["t"]) / 3600.0, np.asarray(tl["ttft_p90"]) * 1e3, lw=0.5, label=f"{name} TTFT")
        ax[3].plot(np.asarray(tl["t"]) / 3600.0, np.asarray(tl["tpot_p90"]) * 1e3, lw=0.5, label=f"{name} TPOT")
    if oracle is not None:
        total = np.sum(list(oracle.values()), axis=0)
        ax[1].step(np.arange(len(total)) * oracle_interval_s / 3600.0, total, where="post", lw=0.8, color="k",
                   label="oracle sizes (hindsight)")
    ax[1].set_ylabel("replicas (all pools)")
    ax[2].set_ylabel("p90 TTFT per 10 s (ms)")
    ax[3].set_ylabel("p90 TPOT per 10 s (ms)")
    if slo is not None:
        if slo.ttft_p90_s:
            ax[2].axhline(slo.ttft_p90_s * 1e3, color="r", ls="--", lw=0.8)
        if slo.tpot_p90_s:
            ax[3].axhline(slo.tpot_p90_s * 1e3, color="r", ls="--", lw=0.8)
    for a in ax[1:]:
        a.legend(fontsize=7, loc="upper left")
    ax[2].set_yscale("log")
    ax[3].set_yscale("log")
    ax[-1].set_xlabel("hours")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
