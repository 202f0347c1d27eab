"""Autoscaling benchmark in the cluster simulator: Duet's SLO autoscaler vs a queue-length autoscaler.

One run, side by side, on the same trace, service model and routing:
    duet      the SLO autoscaler (cluster/autoscaler.py): forecast x profiled capacity + reactive
    queue     Ray Serve's default policy (cluster/queue_autoscaler.py): target_ongoing_requests per
              replica, upscale_delay 30 s, downscale_delay 600 s; the target is each pool's mean
              requests in flight at its profiled capacity (Little's law), i.e. tuned as well as a
              user with the same profile could
    oracle    the hindsight oracle's schedule played through the simulator (cluster/sim_report.py):
              checks that the oracle sizes are feasible; its replica-hours are the yardstick

Workload (defaults): a day-long synthetic trace, diurnal 4 -> 20 req/s with bursts (2 per hour,
x2 for ~5 min), prompts ~1,000 tokens and long generations ~3,000 tokens (log-normal, cv 1):
a reasoning-style mix, so that a day that needs ~1,000 replicas at its peak is ~1.2 M requests
(what a Python discrete-event simulation replays in well under a minute per policy). Disaggregated:
a prefill pool (TTFT p90 <= 1 s) and a decode pool (TPOT p90 <= 60 ms, up to 1,000 replicas);
replicas take 120 s to start. Service model: prefill 20 ms + 0.1 ms/token; decode step
20 ms + 4 ms per sequence, batches of up to 16 (a GPU-class replica of a mid-size model).

Metrics: SLO attainment = the fraction of requests whose TTFT and TPOT both meet the SLO (target
>= 99%); replica-hours / oracle replica-hours (target <= 1.15x); simulator wall time per run.

    python -m benchmarks.autoscale_sim                 # full day (~3 min for the three runs)
    python -m benchmarks.autoscale_sim --hours 2       # quicker
Writes benchmarks/results/autoscale_sim.json and .png.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from cluster.autoscale_loop import SLOAutoscaler
from cluster.autoscaler import AutoscalerConfig, PoolScaling
from cluster.profile import ServiceModel, SLOTargets
from cluster.queue_autoscaler import QueueLengthAutoscaler, QueueScaling
from cluster.sim_report import OracleScaling, oracle_schedule, plot_timeline, sim_capacity
from cluster.sim_trace import read_azure, read_burstgpt, synthetic_trace
from cluster.simulator import SimPool, Simulation

RESULTS = Path(__file__).resolve().parent / "results"
SVC = ServiceModel(prefill_base_s=0.02, prefill_per_token_s=0.0001, decode_base_s=0.02, decode_per_seq_s=0.004,
                   max_batch=16)
SLO = SLOTargets(ttft_p90_s=1.0, tpot_p90_s=0.06)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hours", type=float, default=24.0, help="trace length (synthetic trace) [24]")
    p.add_argument("--base-rps", type=float, default=4.0)
    p.add_argument("--peak-rps", type=float, default=20.0)
    p.add_argument("--mean-prompt", type=float, default=1000.0)
    p.add_argument("--mean-output", type=float, default=3000.0)
    p.add_argument("--burstgpt", type=Path, help="replay a BurstGPT CSV instead of the synthetic trace")
    p.add_argument("--azure", type=Path, help="replay an Azure LLM inference trace CSV instead")
    p.add_argument("--max-decode", type=int, default=1000, help="decode pool max replicas [1000]")
    p.add_argument("--max-prefill", type=int, default=64)
    p.add_argument("--startup-s", type=float, default=120.0)
    p.add_argument("--route-candidates", type=int, default=2,
                   help="replicas each routing decision sees, sampled (power of two choices, as Ray Serve's router) [2]")
    p.add_argument("--policies", default="duet,queue,oracle")
    p.add_argument("--oracle-interval-s", type=float, default=300.0)
    p.add_argument("--headroom", type=float, default=0.05, help="SLO autoscaler headroom [0.05]")
    p.add_argument("--down-band", type=float, default=0.05, help="SLO autoscaler scale-down band [0.05]")
    p.add_argument("--queue-target-scale", type=float, default=1.0,
                   help="baseline's target_ongoing_requests = this x the in-flight count at capacity [1.0]")
    p.add_argument("--prefill-headroom", type=float, default=1.0,
                   help="prefill pool headroom: ~1%% of the replica-hours here, so it holds a burst's worth [1.0]")
    p.add_argument("--capacity-quantile", type=float, default=99.0,
                   help="profile capacity where this percentile of TTFT/TPOT meets the SLO [99: the 99%% target]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "autoscale_sim.json")
    return p


def _trace(args: argparse.Namespace):
    if args.burstgpt:
        return read_burstgpt(args.burstgpt)
    if args.azure:
        return read_azure(args.azure)
    return synthetic_trace(duration_s=args.hours * 3600, base_rps=args.base_rps, peak_rps=args.peak_rps,
                           bursts_per_hour=2, burst_factor=2, burst_mean_s=300, mean_prompt=args.mean_prompt,
                           mean_output=args.mean_output, seed=args.seed, name="synthetic-diurnal-bursty")


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    trace = _trace(args)
    mp, mo = float(trace.prompt.mean()), float(trace.output.mean())
    q = args.capacity_quantile
    cap_p, inflight_p = sim_capacity(SVC, "prefill", SLO, mean_prompt=mp, mean_output=mo, seed=args.seed, quantile=q)
    cap_d, inflight_d = sim_capacity(SVC, "decode", SLO, mean_prompt=mp, mean_output=mo, seed=args.seed, quantile=q)
    residence_d = inflight_d / cap_d.requests_per_s  # Little: mean time a request spends decoding
    config = AutoscalerConfig(pools=(
        PoolScaling("prefill", "prefill", SLOTargets(ttft_p90_s=SLO.ttft_p90_s), cap_p, 1, args.max_prefill,
                    headroom=args.prefill_headroom),
        PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=SLO.tpot_p90_s), cap_d, 1, args.max_decode,
                    smoothing_s=residence_d)),
        horizon_s=args.startup_s, headroom=args.headroom, down_band=args.down_band)
    sizes, oracle_hours = oracle_schedule(trace, config, args.oracle_interval_s)
    res: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trace": {"name": trace.name, "requests": len(trace), "duration_h": trace.duration_s / 3600,
                  "mean_prompt": mp, "mean_output": mo,
                  "peak_rps_1min": float(trace.rate_series(60.0).max())},
        "service": SVC.__dict__, "slo": SLO.__dict__,
        "capacity": {"prefill_rps": cap_p.requests_per_s, "decode_rps": cap_d.requests_per_s,
                     "prefill_in_flight": inflight_p, "decode_in_flight": inflight_d,
                     "quantile": q, "decode_residence_s": residence_d},
        "oracle": {"replica_hours": oracle_hours, "interval_s": args.oracle_interval_s,
                   "peak_replicas": int(sum(s for s in sizes.values()).max())},
        "runs": {},
    }
    policies = {
        "duet": lambda: SLOAutoscaler(config),
        "queue": lambda: QueueLengthAutoscaler((
            QueueScaling("prefill", inflight_p * args.queue_target_scale, 1, args.max_prefill),
            QueueScaling("decode", inflight_d * args.queue_target_scale, 1, args.max_decode))),
        "oracle": lambda: OracleScaling(sizes, args.oracle_interval_s, args.startup_s),
    }
    results = {}
    for name in args.policies.split(","):
        pools = [SimPool(p, p, SVC, int(sizes[p][0]), args.startup_s) for p in ("prefill", "decode")]
        sim = Simulation(trace, pools, slo=SLO, scaling=policies[name](), route_candidates=args.route_candidates,
                         seed=args.seed)
        r = sim.run()
        results[name] = r
        res["runs"][name] = {
            "slo_attainment": r.attainment, "ttft_p90_s": r.p90("ttft"), "tpot_p90_s": r.p90("tpot"),
            "replica_hours": r.replica_hours, "replica_hours_by_pool": {k: v / 3600 for k, v in r.replica_seconds.items()},
            "vs_oracle": r.replica_hours / oracle_hours,
            "peak_replicas": int(max(a + b for a, b in zip(r.timeline["prefill.alive"], r.timeline["decode.alive"]))),
            "completed": int((~(r.ttft != r.ttft)).sum()), "events": r.events, "wall_s": r.wall_s,
            "cpu_s": r.cpu_s}
        logging.getLogger(__name__).info("%s: %s", name, res["runs"][name])
    res["wall_s"] = time.perf_counter() - t0
    res["_results"] = results
    res["_sizes"] = sizes
    return res


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cluster.autoscale_loop").setLevel(logging.WARNING)
    res = run(args)
    results, sizes = res.pop("_results"), res.pop("_sizes")
    print(f"trace {res['trace']['name']}: {res['trace']['requests']} requests over {res['trace']['duration_h']:.1f} h;"
          f" oracle {res['oracle']['replica_hours']:.0f} replica-hours, peak {res['oracle']['peak_replicas']} replicas")
    print(f"{'policy':8} {'SLO att.':>9} {'TTFT p90':>9} {'TPOT p90':>9} {'rep-hours':>10} {'vs oracle':>9} "
          f"{'peak':>5} {'cpu s':>6} {'wall s':>6}")
    for name, r in res["runs"].items():
        print(f"{name:8} {r['slo_attainment']:9.2%} {r['ttft_p90_s'] * 1e3:7.0f}ms {r['tpot_p90_s'] * 1e3:7.1f}ms "
              f"{r['replica_hours']:10.0f} {r['vs_oracle']:8.3f}x {r['peak_replicas']:5d} {r['cpu_s']:6.1f} "
              f"{r['wall_s']:6.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    png = plot_timeline(results, args.out.with_suffix(".png"), oracle=sizes, oracle_interval_s=args.oracle_interval_s,
                        slo=SLO)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
