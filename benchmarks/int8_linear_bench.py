#!/usr/bin/env python
"""Weight-only int8 linear kernel vs fp32 F.linear on the de-quantized weights (and q4 / Duet fp32).

Run from the repository root::

    .venv/bin/python benchmarks/int8_linear_bench.py            # full run
    .venv/bin/python benchmarks/int8_linear_bench.py --quick    # smoke run

A "sweep" is every matrix a SmolLM2-135M decode step multiplies (30 layers x qkv 960x576, o
576x576, gate/up 3072x576, down 576x1536, then the 49152x576 LM head), random weights, x [T, K]:
T = 1 (batch-1 decode), 8 and 32 (continuous batching, speculative verification) and 512 (prefill;
4 layers, no LM head, as the engine computes logits for the last token only). The int8 matrices
alone are ~135 MB, far more than the last-level cache, so T <= 32 streams weights from DRAM as a
decode step does. Sides, timed in the same run, alternating, 2 threads:

    int8     kernels.int8_linear (weight-only int8, fp32 activations)
    fp32     F.linear on the de-quantized fp32 weights (torch's BLAS): the baseline to beat
    fp32-duet kernels.linear on the same fp32 weights (Duet's GEMV for T <= 16, else F.linear)
    q4       kernels.q4_linear (4-bit weights, int8 activations): the int8 VNNI class of kernel
    int8-tiles, q4-tiles
             the same kernels given the weights' tiles (kernels.int8_tiles / q4_tiles, made once, as a
             loaded model keeps them on a VNNI CPU): no per-call repack of each 16-row tile. On a CPU
             without VNNI the kernel ignores them (the figures then equal int8 / q4).

Timings go through engine_throughput.py's quiet-machine gate; medians over quiet repeats (all
repeats, flagged, when none was quiet). JSON: benchmarks/results/int8_linear_bench[_quick].json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, UTC
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import kernels  # noqa: E402
from benchmarks.engine_throughput import CONTENDED, CpuLoadMeter, QuietGate, code_version, machine_info, quiet_median, record  # noqa: E402
from kernels.quant_formats import dequantize_int8, quantize_int8, quantize_q4  # noqa: E402

logger = logging.getLogger("benchmarks.int8_linear_bench")

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)
SIDES = ("int8", "int8-tiles", "fp32", "fp32-duet", "q4", "q4-tiles")


def make_matrices(layers: int, head: bool) -> list[dict[str, Any]]:
    shapes = LAYER_SHAPES * layers + ([HEAD_SHAPE] if head else [])
    mats = []
    for N, K in shapes:
        w = torch.randn(N, K) / K**0.5
        q, s = quantize_int8(w)
        q4 = quantize_q4(w)
        mats.append({"K": K, "q": q, "s": s, "w": dequantize_int8(q, s, K).contiguous(), "q4": q4,
                     "int8_tiles": kernels.int8_tiles(q), "q4_tiles": kernels.q4_tiles(*q4)})
    return mats


def sweep_fn(side: str, mats: list[dict[str, Any]], xs: dict[int, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            for m in mats:
                x = xs[m["K"]]
                if side == "int8":
                    kernels.int8_linear(x, m["q"], m["s"])
                elif side == "int8-tiles":
                    kernels.int8_linear(x, m["q"], m["s"], tiles=m["int8_tiles"])
                elif side == "q4-tiles":
                    codes, d, mins = m["q4"]
                    kernels.q4_linear(x, codes, d, mins, tiles=m["q4_tiles"])
                elif side == "fp32":
                    F.linear(x, m["w"])
                elif side == "fp32-duet":
                    kernels.linear(x, m["w"])
                else:
                    kernels.q4_linear(x, *m["q4"])
    return run


def measure(T: int, mats: list[dict[str, Any]], repeats: int, gate: QuietGate) -> dict[str, Any]:
    xs = {K: torch.randn(T, K) for K in {m["K"] for m in mats}}
    fns = {side: sweep_fn(side, mats, xs) for side in SIDES}
    for fn in fns.values():
        fn()  # warm-up
    res: dict[str, Any] = {"tokens": T, "matrices": len(mats)}
    for _ in range(repeats):
        for side, fn in fns.items():  # alternating, so a burst of load hits every side alike
            record(res.setdefault(side, {}), "seconds", gate.time(fn))
    for side in SIDES:
        r = res[side]
        r["median_ms"] = 1e3 * quiet_median(r["seconds"], r["seconds_load"])
        r["quiet_runs"] = sum(load <= CONTENDED for load in r["seconds_load"])
    for side in ("fp32", "fp32-duet", "q4"):
        res[f"int8_speedup_vs_{side}"] = res[side]["median_ms"] / res["int8"]["median_ms"]
    for kind in ("int8", "q4"):  # what the tiles save
        res[f"{kind}_tiles_speedup"] = res[kind]["median_ms"] / res[f"{kind}-tiles"]["median_ms"]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 layers, 3 repeats")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 512], help="token counts to measure")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per side (default 9, quick 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    decode_layers = 5 if args.quick else 30
    gate, whole = QuietGate(budget_s=60 if args.quick else 300), CpuLoadMeter()
    ext = kernels._build.load()
    results = []
    decode_mats = make_matrices(decode_layers, head=True)
    for T in [t for t in args.tokens if t <= 64]:
        results.append(measure(T, decode_mats, repeats, gate))
        logger.info("T=%d: %s", T, {s: round(results[-1][s]["median_ms"], 2) for s in SIDES})
    del decode_mats
    prefill_mats = make_matrices(4, head=False)
    for T in [t for t in args.tokens if t > 64]:
        results.append(measure(T, prefill_mats, max(3, repeats // 3), gate))
        logger.info("T=%d: %s", T, {s: round(results[-1][s]["median_ms"], 2) for s in SIDES})
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"int8_linear_bench{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"timestamp": datetime.now(UTC).isoformat(), "machine": machine_info(), "code": code_version(),
           "isa": ext.active_isa() if ext else None, "threads": args.threads, "results": results,
           "contention": {"threshold": CONTENDED, "whole_run_load": whole.read(), "quiet_budget_spent_s": gate.spent_s}}
    out.write_text(json.dumps(doc, indent=1))
    print(f"{'T':>5} " + " ".join(f"{s + ' ms':>15}" for s in SIDES) + "   int8 vs fp32 / q4   tiles: int8 / q4")
    for r in results:
        print(f"{r['tokens']:>5} " + " ".join(f"{r[s]['median_ms']:>15.2f}" for s in SIDES)
              + f"   {r['int8_speedup_vs_fp32']:.2f}x / {r['int8_speedup_vs_q4']:.2f}x"
              + f"   {r['int8_tiles_speedup']:.2f}x / {r['q4_tiles_speedup']:.2f}x")
    print(f"others' load over the run: {doc['contention']['whole_run_load']:.2f}; JSON: {out}")


if __name__ == "__main__":
    main()
