"""``duet profile``: measure one replica's capacity at the SLOs and save it as a profile.

How: the serving benchmark's self-hosted path (cluster/bench/serving.py: a 1-worker deployment
started here, Poisson load from cluster/bench/load_gen.py sent by a child process, percentiles from
cluster/bench/metrics.py) runs at a ladder of rates. The capacity is the highest rate whose
p90 TTFT and p90 TPOT both meet the SLOs, and it is recorded as the throughput that rate actually
achieved; the profile also carries the request mix and a fitted service model for the simulator:

    prefill   TTFT at the lowest rate (an idle replica: no queueing) ~ a + b * prompt tokens,
              least squares over its requests; when that gives a negative term (prompts of too
              similar lengths to separate them), a = the median TTFT and b = 0
    decode    TPOT per rate ~ (c + d * B) / (1 - rho), B = the mean number of sequences decoding at
              that rate (Little's law: achieved throughput x mean decode time), least squares over
              rates of TPOT x (1 - rho) against B. rho = throughput x prefill time of the mean
              prompt: the share of the engine's time spent prefilling, during which (in the
              simulator's colocated replica, cluster/sim/replica.py) decoding stalls. The measured
              TPOT already contains those stalls; fitting c + d B to it directly and simulating the
              stalls again would count them twice.

Only ``colocated`` profiles can be measured today (disaggregated prefill/decode pools are not
wired yet); the file format (cluster/autoscale/profile.py) already holds all three pool types.

    duet profile --slo-ttft-ms 1000 --slo-tpot-ms 100 --rates 0.25,0.5,1,2 --out profiles/smollm2.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from cluster.autoscale.profile import Profile, ProfileError, ReplicaCapacity, ServiceModel, SLOTargets, save_profile

logger = logging.getLogger(__name__)
DEFAULT_OUT = Path("profiles") / "colocated.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name or checkpoint dir")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="p90 TTFT target (ms)")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="p90 TPOT target (ms)")
    p.add_argument("--rates", default="0.25,0.5,1,2,4", help="Poisson rates to step through, req/s, ascending")
    p.add_argument("--num-requests", type=int, default=24, help="requests per rate (default 24)")
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--cpus-per-replica", type=int, default=None, help="worker CPUs (default: config)")
    p.add_argument("--max-batch", type=int, default=64, help="the engine's max_num_seqs, for the service model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"profile JSON (default {DEFAULT_OUT})")
    return p


def profile_from_rates(model: str, slo: SLOTargets, rates: list[dict[str, Any]], machine: dict[str, Any],
                       max_batch: int) -> Profile:
    """Build the profile from serving_bench rate results (its ``rates`` list, router path)."""
    steps = [r for r in rates if r.get("path") == "router"]
    if not steps:
        raise ProfileError("no measured rates to build a profile from")
    ok = [r for r in steps if r["completed"] == r["num_requests"]
          and r["ttft"]["p90_ms"] <= slo.ttft_p90_s * 1e3 and r["tpot"]["p90_ms"] <= slo.tpot_p90_s * 1e3]  # type: ignore[operator]
    if not ok:
        first = steps[0]
        raise ProfileError(f"even {first['rate']} req/s misses the SLOs (p90 TTFT {first['ttft']['p90_ms']:.0f} ms, "
                           f"p90 TPOT {first['tpot']['p90_ms']:.1f} ms): relax --slo-ttft-ms/--slo-tpot-ms or add "
                           "a lower rate to --rates")
    best = max(ok, key=lambda r: r["request_throughput_rps"])
    raw = [rec for r in steps for rec in r["raw"] if rec["chunk_times"]]
    mean_prompt = float(np.mean([rec["prompt_tokens"] for rec in raw]))
    mean_output = float(np.mean([sum(rec["chunk_tokens"]) for rec in raw]))
    return Profile(model=model, pool_type="colocated", slo=slo,
                   capacity=ReplicaCapacity(best["request_throughput_rps"], mean_prompt, mean_output),
                   service=fit_service(steps, max_batch), machine=machine,
                   measured={"capacity_rate": best["rate"],
                             "steps": [{k: r[k] for k in ("rate", "completed", "num_requests", "request_throughput_rps",
                                                          "output_throughput_tps", "ttft", "tpot")} for r in steps]})


def fit_service(steps: list[dict[str, Any]], max_batch: int) -> ServiceModel:
    """The service model of the module docstring, fitted from the rate steps' raw records."""
    idle = [rec for rec in steps[0]["raw"] if rec["chunk_times"]]
    x = np.array([rec["prompt_tokens"] for rec in idle], dtype=float)
    y = np.array([rec["chunk_times"][0] - rec["send"] for rec in idle])
    b, a = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(np.median(y)))
    if a < 0 or b < 0:  # prompts too alike (or too noisy a machine) to separate the two terms
        a, b = float(np.median(y)), 0.0
    batch, tpot = [], []
    for r in steps:
        recs = [rec for rec in r["raw"] if len(rec["chunk_times"]) > 1]
        if not recs:
            continue
        decode_s = np.mean([rec["chunk_times"][-1] - rec["chunk_times"][0] for rec in recs])
        batch.append(r["request_throughput_rps"] * decode_s)
        prefill_s = a + b * float(np.mean([rec["prompt_tokens"] for rec in recs]))
        rho = min(0.9, r["request_throughput_rps"] * prefill_s)  # share of time prefilling (decode stalled)
        tpot.append(r["tpot"]["p50_ms"] / 1e3 * (1 - rho))
    d, c = np.polyfit(batch, tpot, 1) if len(batch) > 1 and np.ptp(batch) > 0 else (0.0, float(np.mean(tpot)))
    return ServiceModel(max(float(a), 0.0), max(float(b), 0.0), max(float(c), 1e-6), max(float(d), 0.0), max_batch)


def main(argv: list[str] | None = None) -> int:
    from cluster.bench import serving as serving_bench

    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bench_argv = ["--model", args.model, "--rates", args.rates, "--num-requests", str(args.num_requests),
                  "--min-output", str(args.min_output), "--max-output", str(args.max_output),
                  "--overhead-requests", "0", "--seed", str(args.seed), "--slo-ttft-ms", str(args.slo_ttft_ms),
                  "--slo-tpot-ms", str(args.slo_tpot_ms), "--timeout", str(args.timeout), "--no-plot"]
    if args.cpus_per_replica is not None:
        bench_argv += ["--cpus-per-replica", str(args.cpus_per_replica)]
    slo = SLOTargets(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    try:
        res = serving_bench.run(serving_bench.build_parser().parse_args(bench_argv))
        machine = {**res.get("machine", {}), "cpus_per_replica": args.cpus_per_replica}
        profile = profile_from_rates(args.model, slo, res.get("rates", []), machine, args.max_batch)
    except (ValueError, ProfileError) as e:
        print(f"duet profile: error: {e}", file=sys.stderr)
        return 2
    path = save_profile(profile, args.out)
    c = profile.capacity
    print(f"capacity {c.requests_per_s:.3f} req/s ({c.prompt_tokens_per_s:.0f} prompt tok/s, "
          f"{c.output_tokens_per_s:.0f} output tok/s) at p90 TTFT <= {args.slo_ttft_ms:g} ms, "
          f"p90 TPOT <= {args.slo_tpot_ms:g} ms; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
