"""The chunked-prefill token budget under load: the fixed 512 tokens per step vs ``target_itl_ms``.

    .venv/bin/python benchmarks/itl_budget.py [--quick] [--quant q4] [--concurrency 8,32,64]
        [--prompt-tokens 128] [--output-tokens 64] [--target-factor 1.5] [--threads 1] [--out PATH]

Workload: N streams, closed loop (a finished request is replaced by a new prompt at once, so
prompts keep arriving while N - 1 others decode), --requests-per-stream requests each, distinct
prompts of --prompt-tokens tokens, exactly --output-tokens out (ignore_eos), greedy. The offline
engine is driven directly (no serving path: what is measured is the scheduler's choice).

Per N, one calibration run measures the decode-only step time d(N) (median over steps without
prompt tokens, fixed budget); the ITL run then uses target_itl_ms = --target-factor x d(N). Both
policies run the same prompts, alternating which goes first per repeat (--repeats), each on a
fresh engine:

    ITL p50 / p99   gap between a request's consecutive tokens (a step's wall time); "steady": only
                    requests admitted after the first N (the opening burst of N prompts at once, the
                    same for both policies, and the ITL policy's warm-up, are left out)
    TTFT p50 / p99  admission (when the stream's previous request ended) -> first token
    throughput      output tokens / wall time

JSON at ``benchmarks/results/itl_budget.json`` (``_quick`` with --quick); medians over repeats and
the ratios target / fixed. The machine's load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def build(args: argparse.Namespace, target_itl_ms: float | None):
    from workers.build import build_engine
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.models.assets.resolve import resolve_model

    config = EngineConfig(model=str(resolve_model(args.model)), quantization=args.quant,
                          cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_mib << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, target_itl_ms=target_itl_ms))
    engine = build_engine(config)
    engine.warm_up()
    return engine


def run(engine: Any, n: int, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop at concurrency n over ``prompts``; per-token timings."""
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    queue = list(enumerate(prompts))
    admitted: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    steady: list[float] = []  # ITL of requests after the opening burst
    ttft: list[float] = []
    decode_steps: list[float] = []
    tokens = 0

    def admit(now: float) -> None:
        i, p = queue.pop(0)
        engine.add_request(f"r{i}", p, params)
        admitted[f"r{i}"] = now

    t0 = time.perf_counter()
    for _ in range(min(n, len(queue))):
        admit(t0)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        st = engine.last_step
        if st is not None and st.num_prefill_tokens == 0:
            decode_steps.append(st.total_s)
        for o in outs:
            tokens += len(o.new_token_ids)
            rid = o.request_id
            if rid in last:
                itl.append(now - last[rid])
                if int(rid[1:]) >= n:
                    steady.append(now - last[rid])
            elif o.new_token_ids:
                ttft.append(now - admitted[rid])
            last[rid] = now
            if o.finished:
                last.pop(rid)
                if queue:
                    admit(now)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "itl_p50_ms": 1e3 * _pct(itl, 0.5),
            "itl_p99_ms": 1e3 * _pct(itl, 0.99), "steady_itl_p50_ms": 1e3 * _pct(steady, 0.5),
            "steady_itl_p99_ms": 1e3 * _pct(steady, 0.99), "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * _pct(ttft, 0.99), "decode_step_ms": 1e3 * _pct(decode_steps, 0.5)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quant", default="q4")
    p.add_argument("--concurrency", default="8,32,64")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--target-factor", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-mib", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="concurrency 8,32; 2 requests per stream; 32 tokens; 1 repeat")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests_per_stream, args.output_tokens, args.repeats = "8,32", 2, 32, 1
    torch.set_num_threads(args.threads)
    out = args.out or RESULTS / ("itl_budget_quick.json" if args.quick else "itl_budget.json")
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "threads": args.threads,
                           "load_avg_before": os.getloadavg(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                           "levels": []}
    rng = random.Random(0)
    for n in [int(x) for x in args.concurrency.split(",")]:
        fresh = lambda: [[rng.randrange(100, 30000) for _ in range(args.prompt_tokens)]  # noqa: E731
                         for _ in range(n * args.requests_per_stream)]  # noqa: B023 - called in this iteration
        engine = build(args, None)
        calib = run(engine, n, fresh(), args)
        del engine
        target = args.target_factor * calib["decode_step_ms"]
        runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "target": []}
        for rep in range(args.repeats):
            prompts = fresh()
            order = ("fixed", "target") if rep % 2 == 0 else ("target", "fixed")
            for name in order:
                engine = build(args, None if name == "fixed" else target)
                runs[name].append(run(engine, n, prompts, args))
                del engine
        row: dict[str, Any] = {"concurrency": n, "decode_step_ms": calib["decode_step_ms"], "target_itl_ms": target}
        for name, rs in runs.items():
            row[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            row[name]["runs"] = rs
        row["ratios"] = {k: row["target"][k] / row["fixed"][k] for k in
                         ("itl_p50_ms", "itl_p99_ms", "steady_itl_p99_ms", "ttft_p50_ms", "tokens_per_s")}
        res["levels"].append(row)
        f, t = row["fixed"], row["target"]
        print(f"N={n:3d} decode step {calib['decode_step_ms']:.0f} ms, target {target:.0f} ms | fixed 512: ITL p50 "
              f"{f['itl_p50_ms']:.0f} p99 {f['itl_p99_ms']:.0f} (steady {f['steady_itl_p99_ms']:.0f}) ms, TTFT p50 {f['ttft_p50_ms']:.0f}, {f['tokens_per_s']:.1f} "
              f"tok/s | target: ITL p50 {t['itl_p50_ms']:.0f} p99 {t['itl_p99_ms']:.0f} ms, TTFT p50 {t['ttft_p50_ms']:.0f}, "
              f"{t['tokens_per_s']:.1f} tok/s", flush=True)
    res["load_avg_after"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} (load average {res['load_avg_before']} -> {res['load_avg_after']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
