"""Autoscaling benchmark in the cluster simulator: Duet's SLO autoscaler vs a queue-length autoscaler.

One run, side by side, on the same trace, service model and routing:
    duet          the SLO autoscaler (cluster/autoscale/slo.py): two-window rate estimate x profiled
                  capacity + reactive, the decode pool ``fed_by`` the prefill pool (its bursts
                  capped at what prefill admits), scaling down by migration (the simulator's MigrationModel,
                  cluster/sim/migration.py: removed replicas move their running requests away),
                  with the decode pool's rebalancer on (hot replicas hand sequences to cool ones)
    duet-migrate  the same, rebalancer off
    duet-drain    the same policy, scale-down by draining (removed replicas finish their requests),
                  no migration at all
    duet-standby  ``duet`` with standby replicas: the autoscaler keeps as many as the bursts it saw
                  lately need (cluster/autoscale/standby.py, at most --max-standby per pool), a
                  scale-up promotes them (they serve after the measured standby time), and each
                  costs --standby-cost replicas while it waits (counted in replica-hours)
    today         the SLO autoscaler as it was before scale-down by migration: one rate window
                  (short_window_s 0), no recovery hold, draining, headroom 0.05 / band 0.05 /
                  prefill headroom 1.0 (the values tuned on this file's default day trace)
    queue         Ray Serve's default policy (cluster/autoscale/queue_length.py): target_ongoing_requests per
                  replica, upscale_delay 30 s, downscale_delay 600 s; the target is each pool's mean
                  requests in flight at its profiled capacity (Little's law), i.e. tuned as well as a
                  user with the same profile could; draining
    queue-migrate the same, scaling down by migration, rebalancer on
    oracle        the hindsight oracle's schedule played through the simulator (cluster/sim/report.py),
                  scaling down by migration, rebalancer on: checks that the oracle sizes are
                  feasible; its replica-hours are the yardstick

Workload (defaults): a day-long synthetic trace, diurnal 4 -> 20 req/s with bursts (2 per hour,
x2 for ~5 min), prompts ~1,000 tokens and long generations ~3,000 tokens (log-normal, cv 1):
a reasoning-style mix, so that a day that needs ~1,000 replicas at its peak is ~1.2 M requests
(what a Python discrete-event simulation replays in well under a minute per policy). Disaggregated:
a prefill pool (TTFT p90 <= 1 s) and a decode pool (TPOT p90 <= 60 ms, up to 1,000 replicas).
Service model: prefill 20 ms + 0.1 ms/token; decode step 20 ms + 4 ms per sequence, batches of up to
16 (a GPU-class replica of a mid-size model).

Start-up: measured, not assumed (cluster/sim/startup.py): a new replica takes the profile's
``cold_s`` (or ``shared_s`` with --startup-kind shared), a promoted standby its ``standby_s`` (or,
with --standby-load process, a warm worker process's ``prestarted_s``),
from --startup-profile's entry --startup-model (default: SmolLM2-135M-Instruct on CPU, measured by
benchmarks/startup_bench.py); --startup-s overrides it with a constant (120 s: the assumption of
the earlier tables in benchmarks/README.md). The autoscaler's horizon is the new replica's start-up.

Metrics: SLO attainment = the fraction of requests whose TTFT and TPOT both meet the SLO (target
>= 99%); replica-hours / oracle replica-hours (target <= 1.2x); peak replicas / the oracle's peak;
migrations and the median / p90 time a removed decode replica that held requests took to leave
(idle ones leave at once); simulator CPU time per run.
benchmarks/autoscale_traces.py runs this on a suite of differently shaped traces.

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
from collections.abc import Callable
from typing import Any

from cluster.autoscale.loop import SLOAutoscaler
from cluster.autoscale.slo import AutoscalerConfig, PoolScaling
from cluster.autoscale.profile import ServiceModel, SLOTargets
from cluster.autoscale.queue_length import QueueLengthAutoscaler, QueueScaling
from cluster.sim.pool import MigrationModel
from cluster.sim.report import OracleScaling, oracle_schedule, plot_timeline, sim_capacity
from cluster.sim.trace import Trace, read_azure, read_burstgpt, synthetic_trace
from cluster.sim.pool import SimPool
from cluster.sim.simulator import Simulation
from cluster.sim.startup import DEFAULT_KEY, DEFAULT_PROFILES, load_startup

RESULTS = Path(__file__).resolve().parent / "results"
SVC = ServiceModel(prefill_base_s=0.02, prefill_per_token_s=0.0001, decode_base_s=0.02, decode_per_seq_s=0.004,
                   max_batch=16)
SLO = SLOTargets(ttft_p90_s=1.0, tpot_p90_s=0.06)
POLICIES = ("duet", "duet-standby", "duet-migrate", "duet-drain", "today", "queue", "queue-migrate", "oracle")
TODAY = {"headroom": 0.05, "down_band": 0.05, "prefill_headroom": 1.0}  # the shipped tuning, before migration


def build_parser(description: str | None = None, *, trace_args: bool = True) -> argparse.ArgumentParser:
    """This benchmark's arguments; trace_args=False leaves out the ones that pick the trace (for a
    caller that brings its own traces)."""
    p = argparse.ArgumentParser(description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if trace_args:
        p.add_argument("--hours", type=float, default=24.0, help="trace length (synthetic trace) [24]")
        p.add_argument("--base-rps", type=float, default=4.0)
        p.add_argument("--peak-rps", type=float, default=20.0)
        p.add_argument("--mean-prompt", type=float, default=1000.0)
        p.add_argument("--mean-output", type=float, default=3000.0)
        p.add_argument("--burstgpt", type=Path, help="replay a BurstGPT CSV instead of the synthetic trace")
        p.add_argument("--azure", type=Path, help="replay an Azure LLM inference trace CSV instead")
    p.add_argument("--max-decode", type=int, default=1000, help="decode pool max replicas [1000]")
    p.add_argument("--max-prefill", type=int, default=64)
    p.add_argument("--startup-s", type=float, default=None,
                   help="a new replica's start-up, a constant (default: measured, from --startup-profile)")
    p.add_argument("--startup-profile", type=Path, default=DEFAULT_PROFILES,
                   help="measured start-ups (cluster/sim/startup.py) [cluster/sim/data/startup_profiles.json]")
    p.add_argument("--startup-model", default=DEFAULT_KEY, help=f"<model>@<device> entry of the profile [{DEFAULT_KEY}]")
    p.add_argument("--startup-kind", default="cold", choices=("cold", "shared"),
                   help="a new replica's start-up: cold (weights from disk) or shared (the node holds them) [cold]")
    p.add_argument("--standby-s", type=float, default=None, help="a promoted standby's start-up (default: measured)")
    p.add_argument("--standby-load", default="model", choices=("model", "process"),
                   help="which measured promotion --standby-s defaults to: a loaded standby's (model) or a warm "
                        "worker process's (process: the profile's prestarted_s) [model]")
    p.add_argument("--max-standby", type=int, default=1000, help="duet-standby: most standby replicas per pool; "
                   "the burst risk decides how many [1000: no cap]")
    p.add_argument("--standby-cost", type=float, default=0.1,
                   help="duet-standby: one standby replica's cost in serving replicas [0.1]")
    p.add_argument("--route-candidates", type=int, default=2,
                   help="replicas each routing decision sees, sampled (power of two choices, as Ray Serve's router) [2]")
    p.add_argument("--policies", default="duet,today,queue,oracle", help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--oracle-interval-s", type=float, default=300.0)
    p.add_argument("--headroom", type=float, default=0.1,
                   help="SLO autoscaler headroom [0.1: chosen on autoscale_traces.py's tuning traces]")
    p.add_argument("--down-band", type=float, default=0.0, help="SLO autoscaler scale-down band [0.0: likewise]")
    p.add_argument("--prefill-headroom", type=float, default=0.25,
                   help="prefill pool headroom: a small share of the replica-hours, so it holds part of a burst [0.25]")
    p.add_argument("--short-window-s", type=float, default=30.0, help="SLO autoscaler burst window [30]")
    p.add_argument("--burst-sigmas", type=float, default=4.0, help="SLO autoscaler burst threshold [4]")
    p.add_argument("--queue-target-scale", type=float, default=1.0,
                   help="baseline's target_ongoing_requests = this x the in-flight count at capacity [1.0]")
    p.add_argument("--capacity-quantile", type=float, default=99.0,
                   help="profile capacity where this percentile of TTFT/TPOT meets the SLO [99: the 99%% target]")
    p.add_argument("--kv-bytes-per-token", type=float, default=MigrationModel().kv_bytes_per_token,
                   help="migration: KV bytes per context token [131072: a Llama-3-8B-shaped model in bf16]")
    p.add_argument("--bandwidth-gbs", type=float, default=MigrationModel().bandwidth_bytes_per_s / 1e9,
                   help="migration: GB/s over a draining replica's link [1.0]")
    p.add_argument("--pause-s", type=float, default=MigrationModel().pause_s, help="migration: pause per request [0.2]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "autoscale_sim.json")
    return p


def _trace(args: argparse.Namespace) -> Trace:
    if args.burstgpt:
        return read_burstgpt(args.burstgpt)
    if args.azure:
        return read_azure(args.azure)
    return synthetic_trace(duration_s=args.hours * 3600, base_rps=args.base_rps, peak_rps=args.peak_rps,
                           bursts_per_hour=2, burst_factor=2, burst_mean_s=300, mean_prompt=args.mean_prompt,
                           mean_output=args.mean_output, seed=args.seed, name="synthetic-diurnal-bursty")


def resolve_startup(args: argparse.Namespace) -> None:
    """Fill ``args.startup_s`` and ``args.standby_s`` from the measured profile unless given."""
    if args.startup_s is None or args.standby_s is None:
        measured = load_startup(args.startup_profile, args.startup_model)
        if args.startup_s is None:
            args.startup_s = measured.new_replica_s(args.startup_kind)
        if args.standby_s is None:
            args.standby_s = measured.promoted_s(args.standby_load)
        args.startup_source = measured.source
    else:
        args.startup_source = "given"


def _config(args: argparse.Namespace, cap_p, cap_d, residence_d: float, *, today: bool = False,
            scale_down: str = "migrate", standby: bool = False) -> AutoscalerConfig:
    knobs = TODAY if today else {"headroom": args.headroom, "down_band": args.down_band,
                                 "prefill_headroom": args.prefill_headroom}
    new = {} if today else {"short_window_s": args.short_window_s, "burst_sigmas": args.burst_sigmas,
                            "scale_down": scale_down}
    spares = {"max_standby": args.max_standby, "standby_cost": args.standby_cost} if standby else {}
    return AutoscalerConfig(pools=(
        PoolScaling("prefill", "prefill", SLOTargets(ttft_p90_s=SLO.ttft_p90_s), cap_p, 1, args.max_prefill,
                    headroom=knobs["prefill_headroom"], **spares),
        PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=SLO.tpot_p90_s), cap_d, 1, args.max_decode,
                    smoothing_s=residence_d, fed_by=None if today else "prefill", **spares)),
        horizon_s=args.startup_s, headroom=knobs["headroom"], down_band=knobs["down_band"],
        **({"short_window_s": 0.0, "hold_when_recovering": False, "scale_down": "drain"} if today else new))


def run(args: argparse.Namespace, trace: Trace | None = None) -> dict[str, Any]:
    """Every policy of ``args.policies`` on ``trace`` (default: the one the arguments describe)."""
    t0 = time.perf_counter()
    resolve_startup(args)
    trace = _trace(args) if trace is None else trace
    mp, mo = float(trace.prompt.mean()), float(trace.output.mean())
    q = args.capacity_quantile
    cap_p, inflight_p = sim_capacity(SVC, "prefill", SLO, mean_prompt=mp, mean_output=mo, seed=args.seed, quantile=q)
    cap_d, inflight_d = sim_capacity(SVC, "decode", SLO, mean_prompt=mp, mean_output=mo, seed=args.seed, quantile=q)
    residence_d = inflight_d / cap_d.requests_per_s  # Little: mean time a request spends decoding
    config = _config(args, cap_p, cap_d, residence_d)
    sizes, oracle_hours = oracle_schedule(trace, config, args.oracle_interval_s)
    oracle_peak = int(sum(s for s in sizes.values()).max())  # type: ignore[union-attr]  # a sum of arrays
    migration = MigrationModel(args.kv_bytes_per_token, args.bandwidth_gbs * 1e9, args.pause_s)
    res: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trace": {"name": trace.name, "requests": len(trace), "duration_h": trace.duration_s / 3600,
                  "mean_prompt": mp, "mean_output": mo,
                  "peak_rps_1min": float(trace.rate_series(60.0).max())},
        "service": SVC.__dict__, "slo": SLO.__dict__, "migration": migration.__dict__,
        "startup": {"new_replica_s": args.startup_s, "standby_s": args.standby_s, "kind": args.startup_kind,
                    "standby_load": args.standby_load,
                    "profile": args.startup_model, "source": args.startup_source},
        "capacity": {"prefill_rps": cap_p.requests_per_s, "decode_rps": cap_d.requests_per_s,
                     "prefill_in_flight": inflight_p, "decode_in_flight": inflight_d,
                     "quantile": q, "decode_residence_s": residence_d},
        "oracle": {"replica_hours": oracle_hours, "interval_s": args.oracle_interval_s, "peak_replicas": oracle_peak},
        "runs": {},
    }

    def queue() -> QueueLengthAutoscaler:
        return QueueLengthAutoscaler((QueueScaling("prefill", inflight_p * args.queue_target_scale, 1, args.max_prefill),
                                      QueueScaling("decode", inflight_d * args.queue_target_scale, 1, args.max_decode)))
    policies: dict[str, tuple[Callable[[], Any], Any, bool]] = {  # name -> (policy factory, how removed replicas leave, decode rebalancer on)
        "duet": (lambda: SLOAutoscaler(config), migration, True),
        "duet-standby": (lambda: SLOAutoscaler(_config(args, cap_p, cap_d, residence_d, standby=True)), migration,
                         True),
        "duet-migrate": (lambda: SLOAutoscaler(config), migration, False),
        "duet-drain": (lambda: SLOAutoscaler(_config(args, cap_p, cap_d, residence_d, scale_down="drain")), None,
                       False),
        "today": (lambda: SLOAutoscaler(_config(args, cap_p, cap_d, residence_d, today=True)), None, False),
        "queue": (queue, None, False),
        "queue-migrate": (queue, migration, True),
        "oracle": (lambda: OracleScaling(sizes, args.oracle_interval_s, args.startup_s), migration, True),
    }
    results = {}
    for name in args.policies.split(","):
        if name not in policies:
            raise SystemExit(f"--policies: unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        make, mig, rebalance = policies[name]
        pools = [SimPool(p, p, SVC, int(sizes[p][0]), args.startup_s, migration=mig,
                         rebalance=rebalance and p == "decode", standby_s=args.standby_s,
                         standby_cost=args.standby_cost) for p in ("prefill", "decode")]
        sim = Simulation(trace, pools, slo=SLO, scaling=make(), route_candidates=args.route_candidates, seed=args.seed)
        r = sim.run()
        results[name] = r
        peak = int(max(a + b for a, b in zip(r.timeline["prefill.alive"], r.timeline["decode.alive"])))
        drains = sorted(x for x in r.migration.drain_s.get("decode", []) if x > 0)  # idle ones leave at once
        res["runs"][name] = {
            "slo_attainment": r.attainment, "missed": int((~r.met).sum()), "ttft_p90_s": r.p90("ttft"),
            "tpot_p90_s": r.p90("tpot"), "replica_hours": r.replica_hours,
            "replica_hours_by_pool": {k: v / 3600 for k, v in r.replica_seconds.items()},
            "vs_oracle": r.replica_hours / oracle_hours, "peak_replicas": peak, "peak_vs_oracle": peak / oracle_peak,
            "migrations": r.migration.migrations, "rebalanced": r.migration.rebalanced,
            "migrated_gb": r.migration.bytes / 1e9,
            "decode_removed": len(r.migration.drain_s.get("decode", [])), "decode_removed_busy": len(drains),
            "decode_leave_s_median": drains[len(drains) // 2] if drains else None,
            "decode_leave_s_p90": drains[int(0.9 * (len(drains) - 1))] if drains else None,
            "completed": int((~(r.ttft != r.ttft)).sum()), "events": r.events, "wall_s": r.wall_s,
            "cpu_s": r.cpu_s, "standby_hours": r.standby_hours, "promotions": sum(r.promotions.values()),
            "standby_peak": int(max(a + b for a, b in zip(r.timeline["prefill.standby"], r.timeline["decode.standby"])))}
        logging.getLogger(__name__).info("%s: %s", name, res["runs"][name])
    res["wall_s"] = time.perf_counter() - t0
    res["_results"] = results
    res["_sizes"] = sizes
    return res


def print_table(res: dict[str, Any]) -> None:
    print(f"trace {res['trace']['name']}: {res['trace']['requests']} requests over {res['trace']['duration_h']:.1f} h;"
          f" oracle {res['oracle']['replica_hours']:.0f} replica-hours, peak {res['oracle']['peak_replicas']} replicas;"
          f" start-up {res['startup']['new_replica_s']:.1f} s, standby {res['startup']['standby_s']:.2f} s")
    print(f"{'policy':13} {'SLO att.':>9} {'missed':>7} {'rep-hours':>10} {'vs oracle':>9} {'peak/or.':>8} "
          f"{'leave s':>8} {'migr.':>6} {'cpu s':>6}")
    for name, r in res["runs"].items():
        leave = f"{r['decode_leave_s_median']:8.1f}" if r["decode_leave_s_median"] is not None else f"{'-':>8}"
        print(f"{name:13} {r['slo_attainment']:9.2%} {r['missed']:7d} {r['replica_hours']:10.0f} {r['vs_oracle']:8.3f}x "
              f"{r['peak_vs_oracle']:7.2f}x {leave} {r['migrations']:6d} {r['cpu_s']:6.1f}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cluster.autoscale.loop").setLevel(logging.WARNING)
    res = run(args)
    results, sizes = res.pop("_results"), res.pop("_sizes")
    print_table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    png = plot_timeline(results, args.out.with_suffix(".png"), oracle=sizes, oracle_interval_s=args.oracle_interval_s,
                        slo=SLO)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
