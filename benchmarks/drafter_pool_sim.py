"""Issue 31 benchmark (d): goodput per unit cost of GPU target pools with CPU drafter pools, vs no
speculation and vs a private drafter per target, in the cluster simulator at 10, 100 and 1,000
target replicas.

One run, side by side, on the same trace, service model, SLOs, routing and autoscaler:
    plain         no speculation: prefill + decode pools, the SLO autoscaler (draining)
    pool-xS       the decode pool drafts on an M:N CPU drafter pool (cluster/sim/spec.py) that the
                  same autoscaler sizes on draft demand and measured benefit
                  (cluster/autoscale/drafter.py); drafter speed S x the measured one
    private-xS    every decode replica has its own CPU drafter of the same speed (today's private
                  drafter actor), batching only its own requests; it costs one drafter per decode
                  replica for the replica's whole life
Each arm's decode capacity (the autoscaler's profile) is measured in the simulator the way
``duet profile`` would measure it on that deployment: one decode replica (with ample drafters for
the pool arm), bisecting the Poisson rate until the p99 TPOT meets the SLO.

Calibration (what is measured, and where; nothing here ran on a GPU):
    drafter       Qwen2.5-Coder-0.5B q4, 1 thread, one draft position over M rows: 46, 53, 77, 92,
                  121, 157 ms for M = 1, 2, 3, 5, 7, 9 (benchmarks/README.md "The pair: where the
                  time goes", 2026-11-23; its JSON was not kept), least squares 29.8 ms + 13.6 ms
                  per row. A remote round's cost beyond compute 5.96 ms (median,
                  benchmarks/results/drafter_pool_bench.json ``overhead.median_remote_beyond_compute_s``,
                  2026-11-28). S > 1 are NOT measured: what a drafter S times faster would give (more
                  cores per replica, a smaller drafter); they show where the CPU pool starts to pay.
    acceptance    a per-token acceptance of 0.85 (mean; Beta-spread per request) at k = 4 gives
                  3.67 tokens per verify, inside the 3.4-4.4 the 0.5B pair measured at batch 1
                  (benchmarks/README.md pair table). Its accepted / drafted is then 0.67, under the
                  0.83-0.94 measured there over shorter windows (2.8-3.9 drafts per verify), so the
                  drafts here are if anything worse than measured
    GPU target    NOT measured (no GPU here): benchmarks/autoscale_sim.py's GPU-class replica,
                  prefill 20 ms + 0.1 ms / token, decode step 20 ms + 4 ms per sequence, batch 16,
                  TTFT p90 <= 1 s, TPOT p90 <= 60 ms; verifying a draft token costs 0.05 of a decode
                  row (a memory-bound GPU step; an assumption)
    cost          one GPU replica-hour = 1 unit; one CPU drafter replica-hour (1 core + its memory) =
                  ``--cpu-cost`` units (0.02: ~$0.06 per vCPU-hour with memory next to ~$3 per
                  H100-hour; an assumption)

Trace: ``hold-double-peak`` of benchmarks/autoscale_traces.py (two cosine days in 6 h, prompts
~1,500, outputs ~1,000; a held-out trace there), its first ``--hours`` (3: one full day), rates
scaled so the plain arm's oracle peak is ~N decode replicas. Nothing in the drafter policy or this
benchmark was tuned on any trace: the drafter pool's settings (ratio 0.25 as the prior,
rows_per_replica = the rows whose round fits the TPOT SLO, min_speedup 1.1) were fixed before the
first run.

Metrics: goodput = requests meeting both SLOs per second of trace; cost = replica-hours x unit
cost; goodput per cost = good requests per cost unit; each ratio against ``plain`` of the same
scale. Speculation counters: acceptance, tokens per verify, requests that drafted / declined (the
adaptive rule said drafting would not pay) / fell back (no drafter replica with room).

    python -m benchmarks.drafter_pool_sim                           # 10, 100 and 1,000 replicas
    python -m benchmarks.drafter_pool_sim --scales 10 --speeds 1,8  # quicker
Writes benchmarks/results/drafter_pool_sim.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.autoscale_sim import SLO, SVC
from benchmarks.autoscale_traces import TRACES
from cluster.autoscale.loop import SLOAutoscaler
from cluster.autoscale.profile import ReplicaCapacity, ServiceModel, SLOTargets
from cluster.autoscale.slo import AutoscalerConfig, PoolScaling
from cluster.sim.pool import SimPool
from cluster.sim.report import oracle_schedule, sim_capacity
from cluster.sim.simulator import Simulation, SimulationError
from cluster.sim.spec import DraftCost, SpecModel
from cluster.sim.trace import Trace, synthetic_trace

RESULTS = Path(__file__).resolve().parent / "results"
TRACE = "hold-double-peak"
# Qwen2.5-Coder-0.5B q4, 1 thread: ms per draft position over M rows (benchmarks/README.md, 2026-11-23).
DRAFT_MS = {1: 46.0, 2: 53.0, 3: 77.0, 5: 92.0, 7: 121.0, 9: 157.0}
REMOTE_BEYOND_COMPUTE_S = 0.00596  # benchmarks/results/drafter_pool_bench.json, 2026-11-28
ACCEPTANCE, K, VERIFY_TOKEN_COST = 0.85, 4, 0.05
AMPLE = ServiceModel(0.0, 0.0, 1e-6, 0.0, 1 << 20)  # a stage that is never the bottleneck
UNUSED = ServiceModel(0.0, 0.0, 0.0, 0.0, 1)  # a drafter pool's service model is not used
MAX_ROWS = 32


def draft_fit() -> tuple[float, float]:
    """(base_s, per_row_s) of one draft position: least squares over DRAFT_MS."""
    m, ms = np.array(list(DRAFT_MS)), np.array(list(DRAFT_MS.values()))
    slope, intercept = np.polyfit(m, ms, 1)
    return float(intercept) / 1e3, float(slope) / 1e3


def drafter(speed: float) -> DraftCost:
    base, per_row = draft_fit()
    return DraftCost(base / speed, per_row / speed, REMOTE_BEYOND_COMPUTE_S, MAX_ROWS)


def rows_per_replica(cost: DraftCost) -> float:
    """The rows one replica batches with its round (k positions + the link) within the TPOT SLO."""
    assert SLO.tpot_p90_s is not None
    rows = ((SLO.tpot_p90_s - cost.link_s) / K - cost.base_s) / cost.per_row_s
    return float(min(MAX_ROWS, max(1, math.floor(rows))))


def arm_pools(arm: str, speed: float, decode: int, drafters: int, prefill: int, svc_prefill: ServiceModel = SVC,
              startup_s: float = 120.0) -> list[SimPool]:
    pools = [SimPool("prefill", "prefill", svc_prefill, prefill, startup_s)]
    if arm == "plain":
        return pools + [SimPool("decode", "decode", SVC, decode, startup_s)]
    cost = drafter(speed)
    if arm == "pool":
        sp = SpecModel(K, ACCEPTANCE, verify_token_cost=VERIFY_TOKEN_COST, drafter_pool="drafters")
        return pools + [SimPool("decode", "decode", SVC, decode, startup_s, spec=sp),
                        SimPool("drafters", "drafter", UNUSED, drafters, 30.0, draft=cost)]
    sp = SpecModel(K, ACCEPTANCE, verify_token_cost=VERIFY_TOKEN_COST, private=cost)
    return pools + [SimPool("decode", "decode", SVC, decode, startup_s, spec=sp)]


def decode_capacity(arm: str, speed: float, mean_prompt: float, mean_output: float, seed: int,
                    requests: int = 3000, iters: int = 10, quantile: float = 99.0) -> ReplicaCapacity:
    """One decode replica's rate at which the ``quantile`` TPOT meets the SLO (module docstring)."""
    hi = SVC.max_batch / (SVC.decode_step_s(SVC.max_batch) * max(mean_output - 1, 1)) * (K + 1)  # > any E
    lo = 0.0
    for _ in range(iters):
        rate = (lo + hi) / 2
        tr = synthetic_trace(duration_s=requests / rate, base_rps=rate, peak_rps=rate, bursts_per_hour=0,
                             mean_prompt=mean_prompt, mean_output=mean_output, seed=seed)
        try:  # an overloaded replica never drains its queue: not meeting the SLO, found out sooner
            res = Simulation(tr, arm_pools(arm, speed, 1, 8, 1, AMPLE, 0.0), slo=SLO, seed=seed, max_drain_s=600).run()
        except SimulationError:
            hi = rate
            continue
        tpot = res.tpot[~np.isnan(res.tpot)]
        if float(np.percentile(tpot, quantile)) <= SLO.tpot_p90_s:  # type: ignore[operator]
            lo = rate
        else:
            hi = rate
    if lo <= 0:
        raise SystemExit(f"{arm} x{speed:g}: no rate meets the TPOT SLO")
    return ReplicaCapacity(lo, mean_prompt, mean_output)


def make_trace(scale: float, hours: float, name: str = TRACE) -> Trace:
    g = dict(TRACES[name])
    g["base_rps"], g["peak_rps"] = g["base_rps"] * scale, g["peak_rps"] * scale
    return synthetic_trace(name=f"{name} x{scale:.3g}", duration_s=hours * 3600, **g)


def autoscaler(arm: str, speed: float, cap_p: ReplicaCapacity, cap_d: ReplicaCapacity, residence_d: float,
               max_decode: int) -> AutoscalerConfig:
    pools = [PoolScaling("prefill", "prefill", SLOTargets(ttft_p90_s=SLO.ttft_p90_s), cap_p, 1, max(8, max_decode // 4),
                         headroom=0.25),
             PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=SLO.tpot_p90_s), cap_d, 1, max_decode,
                         smoothing_s=residence_d, fed_by="prefill")]
    if arm == "pool":
        pools.append(PoolScaling("drafters", "drafter", follows="decode", ratio=0.25, min_replicas=1,
                                 max_replicas=max_decode, rows_per_replica=rows_per_replica(drafter(speed)),
                                 verify_token_cost=VERIFY_TOKEN_COST))
    return AutoscalerConfig(tuple(pools), horizon_s=120.0, scale_down="drain")


def run_scale(n: int, arms: list[tuple[str, float]], args: argparse.Namespace,
              caps: dict[tuple[str, float], ReplicaCapacity]) -> dict[str, Any]:
    cap_plain = caps[("plain", 1.0)]
    scale = n * cap_plain.requests_per_s / TRACES[args.trace]["peak_rps"]
    trace = make_trace(scale, args.hours, args.trace)
    mp, mo = float(trace.prompt.mean()), float(trace.output.mean())
    cap_p, _ = sim_capacity(SVC, "prefill", SLO, mean_prompt=mp, mean_output=mo, seed=args.seed, quantile=99.0)
    out: dict[str, Any] = {"replicas": n, "rate_scale": scale, "requests": len(trace),
                           "duration_h": trace.duration_s / 3600, "mean_prompt": mp, "mean_output": mo,
                           "prefill_capacity_rps": cap_p.requests_per_s, "arms": {}}
    sizes, _ = oracle_schedule(trace, autoscaler("plain", 1.0, cap_p, cap_plain, 0.0, 4 * n), 300.0)
    out["oracle_peak_decode"] = int(sizes["decode"].max())
    for arm, speed in arms:
        name = arm if arm == "plain" else f"{arm}-x{speed:g}"
        cap_d = caps[(arm, speed)]
        residence = mo * (SLO.tpot_p90_s or 0.0) * 0.5  # ~ a request's stay in decode (output x typical TPOT)
        cfg = autoscaler(arm, speed, cap_p, cap_d, residence, 4 * n)
        init = max(1, int(sizes["decode"][0]))
        pools = arm_pools(arm, speed, init, max(1, init // 4), max(1, int(sizes["prefill"][0])))
        t0 = time.process_time()
        sim = Simulation(trace, pools, slo=SLO, scaling=SLOAutoscaler(cfg), route_candidates=args.route_candidates,
                         seed=args.seed)
        r = sim.run()
        hours = {k: v / 3600 for k, v in r.replica_seconds.items()}
        gpu_h = hours.get("prefill", 0.0) + hours.get("decode", 0.0)
        cpu_h = hours.get("drafters", 0.0) + (hours["decode"] if arm == "private" else 0.0)
        cost = gpu_h + args.cpu_cost * cpu_h
        good = int(r.met.sum())
        row: dict[str, Any] = {
            "decode_capacity_rps": cap_d.requests_per_s, "slo_attainment": r.attainment,
            "goodput_rps": good / max(trace.duration_s, 1.0), "gpu_replica_hours": gpu_h,
            "cpu_drafter_replica_hours": cpu_h, "cost_units": cost, "good_per_cost_unit": good / cost,
            "tpot_p90_s": r.p90("tpot"), "ttft_p90_s": r.p90("ttft"),
            "peak_decode": int(max(r.timeline["decode.alive"])), "sim_cpu_s": time.process_time() - t0}
        if arm == "pool":
            row["peak_drafters"] = int(max(r.timeline["drafters.alive"]))
            row["drafter_rows_per_replica"] = rows_per_replica(drafter(speed))
            last = sim.loop.last.get("drafters") if sim.loop else None
            row["last_drafter_decision"] = last.reason if last else ""
        c = r.spec.get("decode")
        if c is not None:
            row.update({"acceptance": c.accepted_tokens / c.draft_tokens if c.draft_tokens else None,
                        "tokens_per_verify": c.emitted_tokens / c.verifies if c.verifies else None,
                        "drafted_requests": c.speculated, "declined_requests": c.declined,
                        "fallback_requests": c.fallbacks})
        out["arms"][name] = row
        logging.getLogger(__name__).info("%d replicas, %s: %s", n, name, row)
    base = out["arms"]["plain"]
    for row in out["arms"].values():
        row["goodput_per_cost_vs_plain"] = row["good_per_cost_unit"] / base["good_per_cost_unit"]
        row["goodput_vs_plain"] = row["goodput_rps"] / base["goodput_rps"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="10,100,1000", help="target decode replicas at the peak [10,100,1000]")
    p.add_argument("--speeds", default="1,8,32", help="drafter speed factors over the measured one [1,8,32]")
    p.add_argument("--hours", type=float, default=3.0, help="trace length [3: one double-peak day]")
    p.add_argument("--trace", default=TRACE, choices=sorted(TRACES),
                   help=f"benchmarks/autoscale_traces.py trace, rates scaled to each size [{TRACE}]")
    p.add_argument("--cpu-cost", type=float, default=0.02, help="CPU drafter replica-hour in GPU replica-hours [0.02]")
    p.add_argument("--route-candidates", type=int, default=8, help="replicas each routing decision sees [8]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "drafter_pool_sim.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cluster.autoscale.loop").setLevel(logging.WARNING)
    speeds = [float(s) for s in args.speeds.split(",")]
    arms = [("plain", 1.0)] + [(a, s) for s in speeds for a in ("pool", "private")]
    probe = make_trace(1.0, 0.5, args.trace)
    mp, mo = float(probe.prompt.mean()), float(probe.output.mean())
    t0 = time.perf_counter()
    caps = {arm: decode_capacity(arm[0], arm[1], mp, mo, args.seed) for arm in arms}
    res: dict[str, Any] = {
        "benchmark": "drafter_pool_sim", "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "loadavg_before": list(os.getloadavg()), "settings": {k: str(v) for k, v in vars(args).items()},
        "calibration": {"draft_ms_per_position": DRAFT_MS, "draft_fit_s": draft_fit(),
                        "remote_beyond_compute_s": REMOTE_BEYOND_COMPUTE_S, "acceptance": ACCEPTANCE, "k": K,
                        "verify_token_cost": VERIFY_TOKEN_COST, "target_service": SVC.__dict__, "slo": SLO.__dict__},
        "decode_capacity_rps": {(a if a == "plain" else f"{a}-x{s:g}"): c.requests_per_s for (a, s), c in caps.items()},
        "scales": {}}
    for n in (int(x) for x in args.scales.split(",")):
        res["scales"][str(n)] = run_scale(n, arms, args, caps)
        print_table(res["scales"][str(n)])
    res["wall_s"] = time.perf_counter() - t0
    res["loadavg_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    print(f"wrote {args.out}")
    return 0


def print_table(s: dict[str, Any]) -> None:
    print(f"\n{s['replicas']} replicas at the peak: {s['requests']} requests over {s['duration_h']:.1f} h")
    print(f"{'arm':12} {'cap rps':>8} {'SLO att.':>9} {'GPU h':>8} {'CPU h':>8} {'good/cost':>10} {'vs plain':>9} "
          f"{'tok/verify':>10} {'drafted':>8} {'declined':>9} {'fallback':>9}")
    for name, r in s["arms"].items():
        tv = r.get("tokens_per_verify")
        print(f"{name:12} {r['decode_capacity_rps']:8.3f} {r['slo_attainment']:9.2%} {r['gpu_replica_hours']:8.1f} "
              f"{r['cpu_drafter_replica_hours']:8.1f} {r['good_per_cost_unit']:10.1f} "
              f"{r['goodput_per_cost_vs_plain']:8.3f}x {tv if tv is None else round(tv, 2)!s:>10} "
              f"{r.get('drafted_requests', '-')!s:>8} {r.get('declined_requests', '-')!s:>9} "
              f"{r.get('fallback_requests', '-')!s:>9}")


if __name__ == "__main__":
    sys.exit(main())
