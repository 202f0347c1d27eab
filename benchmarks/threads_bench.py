"""A worker's threads when another process takes a core: OpenMP wait policy and niceness.

    .venv/bin/python benchmarks/threads_bench.py [--quick] [--threads 2] [--batches 1,16] [--steps 30] [--out PATH]

Each configuration runs in its own child process (the OpenMP runtime reads OMP_WAIT_POLICY once,
when torch loads): an engine (--quant, --threads torch threads) with B requests decoding, the
median and p90 of --steps decode steps. Conditions:

    alone      nothing of ours besides the engine (the machine's other load is recorded)
    one core   a busy-loop process pinned to CPU 0 (niceness 0) runs for the whole measurement,
               as a co-located process would: one of the engine's threads shares its core

Configurations: OMP_WAIT_POLICY unset (libgomp's default: spin ~300k iterations, then sleep),
PASSIVE (Duet's default, ``omp_wait_policy: passive``) and ACTIVE, all at niceness 0; and PASSIVE
at niceness 15 (Ray's default for worker processes) beside the busy loop. JSON at
``benchmarks/results/threads_bench.json`` (``_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_CHILD = r'''
import json, os, statistics, sys, time
import torch
a = json.loads(sys.argv[1])
os.setpriority(os.PRIO_PROCESS, 0, a["nice"])
torch.set_num_threads(a["threads"])
from workers.build import build_engine
from workers.config import EngineConfig
from workers.models.assets.resolve import resolve_model
from workers.sampling_params import SamplingParams
engine = build_engine(EngineConfig(model=str(resolve_model(a["model"])), quantization=a["quant"]))
engine.warm_up()
out = {}
for b in a["batches"]:
    for i in range(b):
        engine.add_request(f"b{b}-{i}", [100 + (7 * i + j) % 20000 for j in range(32)],
                           SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
    while any(not s.in_decode for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    ts = []
    for _ in range(a["steps"]):
        t = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t)
    for i in range(b):
        engine.abort(f"b{b}-{i}")
    ts.sort()
    out[str(b)] = {"p50_ms": 1e3 * statistics.median(ts), "p90_ms": 1e3 * ts[int(0.9 * (len(ts) - 1))]}
print(json.dumps(out))
'''

_BUSY = "import os; os.sched_setaffinity(0, {0}); os.setpriority(os.PRIO_PROCESS, 0, 0)\nwhile True: pass"


def run(args: argparse.Namespace, policy: str | None, nice: int, busy: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    payload = {"model": args.model, "quant": args.quant, "threads": args.threads, "batches": args.batches,
               "steps": args.steps, "nice": nice}
    hog = subprocess.Popen([sys.executable, "-c", _BUSY]) if busy else None
    try:
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(payload)], env=env, capture_output=True,
                             text=True, timeout=args.timeout)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return {"load_1min": load, "batches": json.loads(out.stdout.strip().splitlines()[-1])}
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quant", default="q4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true", help="batch 1 only, 10 steps")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.steps = "1", 10
    args.batches = [int(x) for x in args.batches.split(",")]
    out = args.out or RESULTS / ("threads_bench_quick.json" if args.quick else "threads_bench.json")
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "cpus": os.cpu_count(),
                           "threads": args.threads, "load_avg_before": os.getloadavg(), "runs": []}
    configs = [(None, 0, False), ("PASSIVE", 0, False), ("ACTIVE", 0, False),
               (None, 0, True), ("PASSIVE", 0, True), ("ACTIVE", 0, True), ("PASSIVE", 15, True)]
    for policy, nice, busy in configs:
        r = run(args, policy, nice, busy)
        row = {"omp_wait_policy": policy or "unset", "niceness": nice, "condition": "one core" if busy else "alone", **r}
        res["runs"].append(row)
        print(f"{row['omp_wait_policy']:8s} nice {nice:2d} {row['condition']:8s} (load {r['load_1min']:.1f}): "
              + ", ".join(f"B={b}: p50 {v['p50_ms']:.1f} ms p90 {v['p90_ms']:.1f}" for b, v in r["batches"].items()),
              flush=True)
    res["load_avg_after"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} (load average {res['load_avg_before']} -> {res['load_avg_after']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
