"""The engine under the served workload at 32-64 streams, with each CPU batch setting on and off,
side by side in one run (issue 29: what the memory, weight-packing and quantized-batch settings buy).

    .venv/bin/python benchmarks/cpu_batch_bench.py [--streams 32,64] [--waves 5] [--quick] [--out PATH]

Workload (the `make bench-peers` shape, without the HTTP and router hops): N streams, each request a
128-token prompt of distinct random ids (no prefix hits) and exactly 64 output tokens (ignore_eos,
temperature 1.0), closed loop: a finished request is replaced at once, so ~N/64 prompts of 128
tokens join every step, as under AIPerf. One warm-up wave of N requests, then --waves x N measured.
Each variant runs in a child process started with the environment a pool's worker gets
(workers/server/threads.py ``process_env`` of its config: OpenMP policy, malloc tunables), one torch
thread, on whatever cores the OS gives it.

Variants per dtype (every one the same engine code, only the settings differ):

    plain      memory_tuning, prepack_weights off; quantized_batches 'kernel'   (before issue 29's item)
    +memory    memory_tuning on (huge pages for the KV cache and heap, malloc tunables)
    +packed    bf16: + prepack_weights (oneDNN-packed bf16 weights past 8 rows)
    +bf16copy  q4: + quantized_batches 'bf16' (prompt chunks on a packed bf16 copy)
    +kv_bf16   q4: + kv_cache_dtype 'bfloat16' (the KV cache in bf16; the earlier q4 variants pin float32)

Figures: output tokens/s (median over the waves' wall time is not separable, so tokens / measured
wall time), the median decode-only step (ms) and the median step that also took prompt tokens,
with their prompt tokens. JSON at benchmarks/results/cpu_batch_bench.json (``_quick`` with --quick);
the 1-min load average before and after each variant (a busy machine slows all variants alike only
when they run interleaved: --rounds alternates them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_CHILD = r'''
import json, random, statistics, sys, time
from workers.build import build_engine
from workers.llm import engine_config
from workers.models.assets.resolve import resolve_model
from workers.sampling_params import SamplingParams
from workers.server.threads import apply
a = json.loads(sys.argv[1])
config = engine_config(str(resolve_model(a["model"])), **a["settings"])
apply(config, 1)
engine = build_engine(config)
engine.warm_up()
params = SamplingParams(max_tokens=a["output_tokens"], temperature=1.0, ignore_eos=True)
rng = random.Random(0)
k = 0
def admit():
    global k
    engine.add_request(f"q{k}", [rng.randrange(100, 30000) for _ in range(a["prompt_tokens"])], params)
    k += 1
n = a["streams"]
for _ in range(n):
    admit()
done, t0, tokens, decode, mixed = 0, None, 0, [], []
while done < n * (1 + a["waves"]):
    if done >= n and t0 is None:
        t0, tokens = time.perf_counter(), 0
    outs = engine.step()
    st = engine.last_step
    if t0 is not None and st is not None:
        (mixed if st.num_prefill_tokens else decode).append((st.total_s, st.num_prefill_tokens))
    for o in outs:
        tokens += len(o.new_token_ids)
        if o.finished:
            done += 1
            admit()
wall = time.perf_counter() - t0
print(json.dumps({"tokens": tokens, "wall_s": wall,
                  "decode_step_ms": 1e3 * statistics.median(s for s, _ in decode) if decode else None,
                  "mixed_step_ms": 1e3 * statistics.median(s for s, _ in mixed) if mixed else None,
                  "mixed_prompt_tokens": statistics.median(p for _, p in mixed) if mixed else None,
                  "steps": len(decode) + len(mixed)}))
'''

VARIANTS: dict[str, dict[str, list[tuple[str, dict[str, Any]]]]] = {
    "bf16": {"variants": [
        ("plain", {"dtype": "bfloat16", "memory_tuning": False, "prepack_weights": False}),
        ("+memory", {"dtype": "bfloat16", "memory_tuning": True, "prepack_weights": False}),
        ("+packed", {"dtype": "bfloat16", "memory_tuning": True, "prepack_weights": True}),
    ]},
    "q4": {"variants": [
        ("plain", {"quantization": "q4", "memory_tuning": False, "quantized_batches": "kernel",
                   "kv_cache_dtype": "float32"}),
        ("+memory", {"quantization": "q4", "memory_tuning": True, "quantized_batches": "kernel",
                     "kv_cache_dtype": "float32"}),
        ("+bf16copy", {"quantization": "q4", "memory_tuning": True, "quantized_batches": "bf16",
                       "kv_cache_dtype": "float32"}),
        ("+kv_bf16", {"quantization": "q4", "memory_tuning": True, "quantized_batches": "bf16",
                      "kv_cache_dtype": "bfloat16"}),
    ]},
}


def run_variant(args: argparse.Namespace, settings: dict[str, Any], streams: int) -> dict[str, Any]:
    from workers.llm import engine_config
    from workers.server.threads import process_env

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OMP_WAIT_POLICY")}
    env.update(process_env(engine_config(args.model, **settings)))
    env["PYTHONPATH"] = f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"
    payload = {"model": args.model, "settings": settings, "streams": streams, "waves": args.waves,
               "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    before = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(payload)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"variant {settings} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["tokens_per_s"] = r["tokens"] / r["wall_s"]
    r["loadavg_1m"] = [before, os.getloadavg()[0]]
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtypes", default="bf16,q4")
    p.add_argument("--streams", default="32,64")
    p.add_argument("--waves", type=int, default=5, help="measured waves of N requests (after one warm-up wave)")
    p.add_argument("--rounds", type=int, default=1, help="times each variant runs, interleaved (median kept)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="streams 32, 2 waves")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.waves = "32", 2
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        for n in streams:
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.rounds):
                for name, settings in VARIANTS[dtype]["variants"]:
                    runs.setdefault(name, []).append(run_variant(args, settings, n))
            base = statistics.median(r["tokens_per_s"] for r in runs["plain"])
            for name, settings in VARIANTS[dtype]["variants"]:
                rs = runs[name]
                tps = statistics.median(r["tokens_per_s"] for r in rs)
                row = {"dtype": dtype, "streams": n, "variant": name, "settings": settings, "tokens_per_s": tps,
                       "vs_plain": tps / base, "runs": rs}
                rows.append(row)
                mid = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
                print(f"{dtype:4s} N={n:3d} {name:10s} {tps:7.1f} tok/s  x{tps / base:.2f}  decode step "
                      f"{mid['decode_step_ms']:.1f} ms, step with {mid['mixed_prompt_tokens']:.0f} prompt tokens "
                      f"{mid['mixed_step_ms']:.1f} ms  (load {mid['loadavg_1m'][0]:.1f} -> {mid['loadavg_1m'][1]:.1f})",
                      flush=True)
    out = args.out or RESULTS / ("cpu_batch_bench_quick.json" if args.quick else "cpu_batch_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import platform

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out.write_text(json.dumps({"commit": commit, "machine": platform.processor() or platform.machine(),
                               "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
