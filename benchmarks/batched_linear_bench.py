#!/usr/bin/env python
"""Batched linear layers per dtype on CPU: Duet's own kernels vs torch (MKL fp32, oneDNN bf16), side by side.

Run from the repository root::

    .venv/bin/python benchmarks/batched_linear_bench.py                 # 1 thread, T = 1 2 4 8 12 16 32 64
    .venv/bin/python benchmarks/batched_linear_bench.py --quick         # fewer repeats
    .venv/bin/python benchmarks/batched_linear_bench.py --threads 2 --tokens 1 8 32 64

What is timed, for T rows of x (decode batches of T sequences) through one decoder layer's four
SmolLM2-135M matrices in order (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), seconds
per layer, median over repeats (each repeat runs the layer back to back for >= ~20 ms; the sides
take turns within each round of repeats, so a busy neighbour slows all of them alike):

    fp32-torch   F.linear on fp32 (MKL's GEMM / GEMV)                          -- the plain path
    fp32         kernels.linear (Duet's GEMV up to GEMV_MAX_TOKENS rows, then F.linear)
    bf16-gemv    the C++ bf16 GEMV at every T (AVX512-BF16 vdpbf16ps where the CPU has it)
    bf16-onednn  F.linear on bf16 tensors: oneDNN's bf16 GEMM (AMX / AVX512-BF16 where the CPU has them)
    bf16         kernels.linear on bf16 (GEMV up to BF16_GEMV_MAX_TOKENS rows, then oneDNN): what
                 the engine runs
    int8         kernels.int8_linear (int8 weights, int8 activations per block of 32; VNNI where present)
    q4           kernels.q4_linear (Q4_1 weights, int8 activations; the q4 x q8 dot)

Ratios are vs fp32-torch in the same run; ``bf16_pick`` says, per T, whether the GEMV or oneDNN was
faster (the threshold BF16_GEMV_MAX_TOKENS in kernels/linear.py follows it). Every timed run waits
for a quiet machine and is redone if others took > 5% of the CPU (engine_throughput.QuietGate);
the JSON (benchmarks/results/batched_linear[_quick].json) holds every raw timing with its load,
the machine (CPU flags included) and the commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import kernels  # noqa: E402
from benchmarks.engine_throughput import QuietGate, code_version, machine_info, quiet_median, record  # noqa: E402
from kernels import _build  # noqa: E402
from kernels.cpu_features import features  # noqa: E402
from kernels.linear import BF16_GEMV_MAX_TOKENS, GEMV_MAX_TOKENS  # noqa: E402
from kernels.quant_formats import quantize_int8, quantize_q4  # noqa: E402

logger = logging.getLogger("batched_linear_bench")

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K]: qkv, o, gate_up, down
TOKENS = [1, 2, 4, 8, 12, 16, 32, 64]
SIDES = ["fp32-torch", "fp32", "bf16-gemv", "bf16-onednn", "bf16", "int8", "q4"]


def layer_fns(T: int, ext: Any) -> dict[str, Callable[[], Any]]:
    g = torch.Generator().manual_seed(T)
    ws = [torch.randn(n, k, generator=g) * k**-0.5 for n, k in SHAPES]
    xs = [torch.randn(T, k, generator=g) for _, k in SHAPES]
    wb, xb = [w.bfloat16() for w in ws], [x.bfloat16() for x in xs]
    i8 = [quantize_int8(w) for w in ws]
    q4 = [quantize_q4(w) for w in ws]

    def run(f: Callable[[int], Any]) -> Callable[[], None]:
        def layer() -> None:
            for i in range(len(SHAPES)):
                f(i)
        return layer

    return {
        "fp32-torch": run(lambda i: F.linear(xs[i], ws[i])),
        "fp32": run(lambda i: kernels.linear(xs[i], ws[i])),
        "bf16-gemv": run(lambda i: ext.gemv(xb[i], wb[i], None)),
        "bf16-onednn": run(lambda i: F.linear(xb[i], wb[i])),
        "bf16": run(lambda i: kernels.linear(xb[i], wb[i])),
        "int8": run(lambda i: kernels.int8_linear(xs[i], *i8[i])),
        "q4": run(lambda i: kernels.q4_linear(xs[i], *q4[i])),
    }


def time_sides(fns: dict[str, Callable[[], Any]], repeats: int, min_rep_s: float,
               gate: QuietGate) -> dict[str, dict[str, Any]]:
    """Each side's seconds per call: repeats rounds, each round times every side once in turn (so load
    from other processes falls on all sides alike), each timing running the call back to back for
    >= min_rep_s; medians over the rounds that were not contended."""
    calls = {}
    for side, fn in fns.items():
        fn()  # warm-up (oneDNN builds its primitive on the first call of a shape)
        t0 = time.perf_counter()
        fn()
        calls[side] = max(1, round(min_rep_s / max(time.perf_counter() - t0, 1e-7)))
    res: dict[str, dict[str, Any]] = {side: {"calls_per_repeat": k} for side, k in calls.items()}
    for rep in range(repeats):
        order = list(fns) if rep % 2 == 0 else list(fns)[::-1]
        for side in order:
            fn, k = fns[side], calls[side]

            def batch(fn: Callable[[], Any] = fn, k: int = k) -> None:
                for _ in range(k):
                    fn()

            record(res[side], "seconds", gate.time(batch), scale=1 / k)
    for d in res.values():
        d["median_s"] = quiet_median(d["seconds"], d["seconds_load"])
    return res


@torch.inference_mode()
def run(tokens: list[int], repeats: int, min_rep_s: float, threads: int, quiet_budget_s: float) -> dict[str, Any]:
    torch.set_num_threads(threads)
    ext = _build.ext()
    assert ext is not None, f"the C++ kernels did not build: {_build.unavailable_reason()}"
    gate = QuietGate(quiet_budget_s)
    rows = []
    for T in tokens:
        fns = layer_fns(T, ext)
        row: dict[str, Any] = {"tokens": T, **time_sides({side: fns[side] for side in SIDES}, repeats, min_rep_s, gate)}
        base = row["fp32-torch"]["median_s"]
        row["speedup_vs_fp32_torch"] = {side: base / row[side]["median_s"] for side in SIDES}
        gemv, onednn = row["bf16-gemv"]["median_s"], row["bf16-onednn"]["median_s"]
        row["bf16_pick"] = "gemv" if gemv < onednn else "onednn"
        row["bf16_gemv_vs_onednn"] = onednn / gemv
        logger.info("T=%-3d %s | bf16 faster: %s", T, "  ".join(f"{s} x{row['speedup_vs_fp32_torch'][s]:.2f}"
                                                               for s in SIDES), row["bf16_pick"])
        rows.append(row)
    return {
        "benchmark": "batched_linear_bench",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "threads": threads,
        "shapes_nk": SHAPES,
        "thresholds": {"GEMV_MAX_TOKENS": GEMV_MAX_TOKENS, "BF16_GEMV_MAX_TOKENS": BF16_GEMV_MAX_TOKENS},
        "kernel_paths": {"isa": ext.active_isa(), "bf16_gemv_native": ext.gemv_bf16_native(),
                         "quant": ext.quant_path()},
        "cpu_features": vars(features()),
        "loadavg": os.getloadavg(),
        "machine": machine_info(),
        "code": code_version(),
        "rows": rows,
    }


def print_report(res: dict[str, Any]) -> None:
    print(f"seconds per SmolLM2 layer (4 matrices), {res['threads']} thread(s), medians; load {res['loadavg']}")
    print("T    " + "".join(f"{s:>13}" for s in SIDES) + "   bf16 pick")
    for r in res["rows"]:
        print(f"{r['tokens']:<5}" + "".join(f"{r[s]['median_s'] * 1e6:>11.0f}us" for s in SIDES)
              + f"   {r['bf16_pick']} (x{r['bf16_gemv_vs_onednn']:.2f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="rows of x (batch sizes)")
    parser.add_argument("--threads", type=int, default=1, help="torch / kernel threads (default 1)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/batched_linear[_quick].json)")
    parser.add_argument("--quiet-budget", type=float, default=120.0,
                        help="seconds to spend waiting for quiet / redoing contended runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    repeats, min_rep_s = (3, 0.01) if args.quick else (7, 0.02)
    res = run(args.tokens, repeats, min_rep_s, args.threads, args.quiet_budget)
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"batched_linear{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print_report(res)
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
