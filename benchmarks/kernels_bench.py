#!/usr/bin/env python
"""Duet's CPU kernels vs their torch references, and whole-engine decode/prefill with the attention
kernels on and off, in one run.

Run from the repository root::

    .venv/bin/python benchmarks/kernels_bench.py            # full run
    .venv/bin/python benchmarks/kernels_bench.py --quick    # smoke run (fewer repeats, N=8)

Three parts, all with ``torch.set_num_threads(2)`` (``--threads``), fp32, SmolLM2-135M-Instruct shapes (H = 9 query
heads, G = 3 kv heads, D = 64, hidden 576, intermediate 1536, block size 16 as the engine uses):

1. ops: each kernel (``kernels.<op>``) vs its ``<op>_ref`` on the same inputs, median seconds per
   call over repeats (each repeat runs the call back to back for >= ~20 ms), speedup = ref / kernel.
   The prefill attention cases also time the engine's plain path (per-chunk SDPA over K/V gathered
   from the cache, with the causal mask offset by the chunk start), since that is what the varlen
   kernel replaces in the engine.
2. decode: whole-engine batch-1 decode tokens/s at context 512 / 2048 / 8192 (SmolLM2's limit), with
   ``kernels.paged_decode_attention`` vs the gather path (its reference: K/V of each sequence
   gathered from the cache, then softmax in torch), toggled in the same engine (every other kernel
   stays on). tokens/s = (N - 1) / (T_N - T_1) for one request whose prompt fills the context minus
   N; the prompt's blocks are prefix-cached by a warm-up, so T_N and T_1 pay the same short prefill
   and their difference is N - 1 decode steps. Greedy tokens of both paths are compared.
3. prefill: whole-engine prefill seconds of a 2048-token prompt (chunks of 512, so three chunks
   attend to a cached prefix) with ``kernels.varlen_paged_attention`` vs the plain SDPA path,
   prefix caching off.

Every timed run waits for a quiet machine and is redone if others took > 5% of the CPU
(engine_throughput.QuietGate); medians are over the quiet runs. JSON (every raw timing with its load,
machine info, commit) goes to benchmarks/results/kernels_bench[_quick].json.

Target: paged decode attention >= 2x its reference at context 2048.
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import (  # also puts the repo root on sys.path
    PASSAGE,
    REPO_ROOT,
    THREADS,
    QuietGate,
    code_version,
    machine_info,
    quiet_median,
    record,
)

import kernels
from kernels.varlen_paged_attention import tree_visibility
from workers.layers import attention as attention_mod
from workers.llm import LLM
from workers.models.assets.prepare import prepare_smollm2
from workers.sampling_params import SamplingParams

logger = logging.getLogger("benchmarks.kernels_bench")

H, G, D, E, I, BS = 9, 3, 64, 576, 1536, 16  # SmolLM2-135M shapes, engine block size
TARGET = {"paged_decode_attention_vs_ref_at_2048": 2.0}


@dataclass(frozen=True)
class Settings:
    op_repeats: int
    min_rep_s: float  # each op repeat runs back to back for at least this long
    decode_contexts: tuple[int, ...]
    decode_tokens: int
    decode_repeats: int
    prefill_tokens: int
    prefill_repeats: int
    quiet_budget_s: float


FULL = Settings(9, 0.05, (512, 2048, 8192), 32, 3, 2048, 3, 300.0)
QUICK = Settings(3, 0.02, (512, 2048, 8192), 8, 1, 1024, 1, 30.0)


# ------------------------------------------------------------------- part 1
def paged_case(ns: list[int], ctxs: list[int], seed: int = 0) -> tuple:
    """Random cache with shuffled blocks; q rows for ns new tokens per sequence with contexts ctxs."""
    g = torch.Generator().manual_seed(seed)
    width = max((c + BS - 1) // BS for c in ctxs)
    nblocks = len(ctxs) * width + 1
    kc, vc = torch.randn(nblocks * BS, G, D, generator=g), torch.randn(nblocks * BS, G, D, generator=g)
    bt = torch.randperm(nblocks, generator=g)[: len(ctxs) * width].view(len(ctxs), width).int()
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(sum(ns), H, D, generator=g), kc, vc, bt, cu, torch.tensor(ctxs, dtype=torch.int32)


def sdpa_path(q, kc, vc, bt, cu, cl, parents=None) -> torch.Tensor:
    """The engine's plain prefill path: per chunk, gather the context, SDPA with an offset causal mask."""
    out = torch.empty_like(q)
    cu_l, cl_l = cu.tolist(), cl.tolist()
    for b, ctx in enumerate(cl_l):
        r0, r1 = cu_l[b], cu_l[b + 1]
        start = ctx - (r1 - r0)
        t = torch.arange(ctx)
        slots = bt[b].long()[t // BS] * BS + t % BS
        kk, vv = kc[slots].transpose(0, 1).unsqueeze(0), vc[slots].transpose(0, 1).unsqueeze(0)
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        if parents is not None:
            mask[:, start:] = tree_visibility(parents[r0:r1])
        qq = q[r0:r1].transpose(0, 1).unsqueeze(0)
        out[r0:r1] = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    return out


def op_cases() -> list[tuple[str, dict[str, Callable[[], Any]]]]:
    """(case name, {side: zero-argument call}); sides: kernel, ref and, for prefill attention, sdpa."""
    g = torch.Generator().manual_seed(0)
    cases: list[tuple[str, dict[str, Callable[[], Any]]]] = []
    for T in (1, 256):
        x, r, w = torch.randn(T, E, generator=g), torch.randn(T, E, generator=g), torch.randn(E, generator=g)
        cases.append((f"rms_norm+residual T={T}", {"kernel": partial(kernels.rms_norm, x, w, 1e-5, r),
                                                   "ref": partial(kernels.rms_norm_ref, x, w, 1e-5, r)}))
        xi = torch.randn(T, 2 * I, generator=g)
        cases.append((f"silu_and_mul T={T}", {"kernel": partial(kernels.silu_and_mul, xi),
                                              "ref": partial(kernels.silu_and_mul_ref, xi)}))
        q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, G, D, generator=g), torch.randn(T, G, D, generator=g)
        cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
        kc, vc, slots = torch.zeros(4096, G, D), torch.zeros(4096, G, D), torch.randperm(4096, generator=g)[:T]
        args = (q, k, v, cos, sin, kc, vc, slots)
        cases.append((f"rotary_and_cache_write T={T}", {"kernel": partial(kernels.rotary_and_cache_write, *args),
                                                        "ref": partial(kernels.rotary_and_cache_write_ref, *args)}))
    xl, wl = torch.randn(1, E, generator=g), torch.randn(2 * I, E, generator=g)
    cases.append(("linear T=1 576->3072", {"kernel": lambda: kernels.linear(xl, wl), "ref": lambda: kernels.linear_ref(xl, wl)}))
    for B, ctx in ((1, 512), (1, 2048), (1, 8192), (8, 2048)):
        q, kc, vc, bt, _, cl = paged_case([1] * B, [ctx] * B)
        a = (q, kc, vc, bt, cl, BS, D**-0.5)
        cases.append((f"paged_decode_attention B={B} ctx={ctx}", {
            "kernel": partial(kernels.paged_decode_attention, *a),
            "ref": partial(kernels.paged_decode_attention_ref, *a)}))
    for label, n, ctx, tree in (("prefill", 512, 512, False), ("chunk", 512, 2048, False),
                                ("verify", 5, 2048, False), ("verify", 5, 8192, False), ("tree verify", 16, 2048, True)):
        q, kc, vc, bt, cu, cl = paged_case([n], [ctx])
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)]) if tree else None  # a binary tree
        va = (q, kc, vc, bt, cu, cl, BS, D**-0.5)
        cases.append((f"varlen_paged_attention {label} n={n} ctx={ctx}", {
            "kernel": partial(kernels.varlen_paged_attention, *va, tree_parents=parents),
            "ref": partial(kernels.varlen_paged_attention_ref, *va, tree_parents=parents),
            "sdpa": partial(sdpa_path, *va[:6], parents=parents)}))
    for T in (1, 512):
        outs = [torch.randn(T, H, D, generator=g) for _ in range(2)]
        lses = [torch.randn(T, H, generator=g) for _ in range(2)]
        cases.append((f"merge_attn_states N=2 T={T}", {"kernel": partial(kernels.merge_attn_states, outs, lses),
                                                      "ref": partial(kernels.merge_attn_states_ref, outs, lses)}))
    return cases


def time_op(fn: Callable[[], Any], s: Settings, gate: QuietGate) -> dict[str, Any]:
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    k = max(1, round(s.min_rep_s / max(time.perf_counter() - t0, 1e-7)))

    def batch() -> None:
        for _ in range(k):
            fn()

    res: dict[str, Any] = {"calls_per_repeat": k}
    for _ in range(s.op_repeats):
        record(res, "seconds", gate.time(batch), scale=1 / k)
    res["median_s"] = quiet_median(res["seconds"], res["seconds_load"])
    return res


def bench_ops(s: Settings, gate: QuietGate) -> list[dict[str, Any]]:
    rows = []
    for name, sides in op_cases():
        row: dict[str, Any] = {"case": name}
        for side, fn in sides.items():
            row[side] = time_op(fn, s, gate)
        row["speedup_vs_ref"] = row["ref"]["median_s"] / row["kernel"]["median_s"]
        if "sdpa" in row:
            row["speedup_vs_sdpa_path"] = row["sdpa"]["median_s"] / row["kernel"]["median_s"]
        logger.info("%-48s %s", name, f"x{row['speedup_vs_ref']:.2f}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------- part 2
@contextlib.contextmanager
def decode_gather_path() -> Iterator[None]:
    """Decode attention through the reference (gather + softmax) in the engine; other kernels stay on."""
    real = attention_mod.paged_decode_attention

    def gather(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out=None):
        res = kernels.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)
        return res if out is None else out.copy_(res)

    attention_mod.paged_decode_attention = gather  # type: ignore[assignment]  # patched for the measurement
    try:
        yield
    finally:
        attention_mod.paged_decode_attention = real


@contextlib.contextmanager
def prefill_sdpa_path() -> Iterator[None]:
    """Prefill attention through the plain per-chunk SDPA path."""
    real = attention_mod.varlen_kernel_available
    attention_mod.varlen_kernel_available = lambda q: False
    try:
        yield
    finally:
        attention_mod.varlen_kernel_available = real


def prompt_ids(llm: LLM, length: int) -> list[int]:
    ids = llm.tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def bench_decode(llm: LLM, s: Settings, gate: QuietGate) -> list[dict[str, Any]]:
    n = s.decode_tokens
    rows = []
    for ctx in s.decode_contexts:
        prompt = prompt_ids(llm, ctx - n)
        params = lambda k: SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)  # noqa: E731
        llm.generate(prompt, params(1))  # prefill once: later calls hit the prefix cache
        row: dict[str, Any] = {"context": ctx, "prompt_tokens": len(prompt), "new_tokens": n}
        paths: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
            "kernel": contextlib.nullcontext, "gather": decode_gather_path}
        for rep in range(s.decode_repeats):
            for name in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
                d = row.setdefault(name, {})
                with paths[name]():
                    t_n = gate.time(lambda: llm.generate(prompt, params(n))[0])  # noqa: B023 - called in this iteration
                    t_1 = gate.time(lambda: llm.generate(prompt, params(1))[0])  # noqa: B023 - called in this iteration
                record(d, "t_n", t_n)
                record(d, "t_1", t_1)
                assert t_n.value.num_cached_tokens > 0, "the prompt must come from the prefix cache"
                d["token_ids"] = t_n.value.token_ids
        for name in paths:
            d = row[name]
            t1 = quiet_median(d["t_1"], d["t_1_load"])
            d["tokens_per_s"] = [(n - 1) / max(t - t1, 1e-9) for t in d["t_n"]]
            d["median_tokens_per_s"] = quiet_median(d["tokens_per_s"], d["t_n_load"])
        row["speedup"] = row["kernel"]["median_tokens_per_s"] / row["gather"]["median_tokens_per_s"]
        row["same_tokens"] = row["kernel"]["token_ids"] == row["gather"]["token_ids"]
        logger.info("decode ctx=%d: kernel %.1f tok/s, gather %.1f tok/s", ctx,
                    row["kernel"]["median_tokens_per_s"], row["gather"]["median_tokens_per_s"])
        rows.append(row)
    return rows


def bench_prefill(model_path: Path, s: Settings, gate: QuietGate) -> dict[str, Any]:
    llm = LLM(str(model_path), enable_prefix_caching=False, max_num_batched_tokens=512, kv_cache_memory_bytes=256 << 20)
    prompt = prompt_ids(llm, s.prefill_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    paths: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "kernel": contextlib.nullcontext, "sdpa": prefill_sdpa_path}
    res: dict[str, Any] = {"prompt_tokens": len(prompt), "chunk_tokens": 512}
    for ctx in paths.values():
        with ctx():
            llm.generate(prompt, params)  # warm-up
    for rep in range(s.prefill_repeats):
        for name in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
            with paths[name]():
                t = gate.time(lambda: llm.generate(prompt, params)[0].token_ids)
            record(res.setdefault(name, {}), "seconds", t)
            res[name]["token_ids"] = t.value
    for name in paths:
        res[name]["median_s"] = quiet_median(res[name]["seconds"], res[name]["seconds_load"])
    res["speedup"] = res["sdpa"]["median_s"] / res["kernel"]["median_s"]
    res["same_tokens"] = res["kernel"]["token_ids"] == res["sdpa"]["token_ids"]
    return res


# ------------------------------------------------------------------- report
def print_report(res: dict[str, Any]) -> None:
    print(f"\nkernels vs references ({res['settings']['threads']} threads, median per call)")
    print(f"{'case':<50} {'kernel ms':>10} {'ref ms':>10} {'x ref':>7} {'sdpa ms':>10} {'x sdpa':>7}")
    for r in res["ops"]:
        sd = f"{r['sdpa']['median_s'] * 1e3:10.3f} {r['speedup_vs_sdpa_path']:7.2f}" if "sdpa" in r else ""
        print(f"{r['case']:<50} {r['kernel']['median_s'] * 1e3:10.3f} {r['ref']['median_s'] * 1e3:10.3f} "
              f"{r['speedup_vs_ref']:7.2f} {sd}")
    print("\nengine batch-1 decode tokens/s: paged-attention kernel vs gather path")
    for r in res["decode"]:
        print(f"  context {r['context']:>5}: kernel {r['kernel']['median_tokens_per_s']:7.1f}  gather "
              f"{r['gather']['median_tokens_per_s']:7.1f}  x{r['speedup']:.2f}  same tokens: {r['same_tokens']}")
    p = res["prefill"]
    print(f"\nengine prefill of {p['prompt_tokens']} tokens (chunks of {p['chunk_tokens']}): varlen kernel "
          f"{p['kernel']['median_s']:.3f} s, SDPA path {p['sdpa']['median_s']:.3f} s, x{p['speedup']:.2f}, "
          f"same tokens: {p['same_tokens']}")
    for name, (got, want) in res["targets"].items():
        print(f"target {name}: {got:.2f} (>= {want}) {'yes' if got >= want else 'NO'}")
    c = res["contention"]
    print(f"contention: {c['still_contended']} of {c['timed_runs']} kept runs had others > 5% of the CPU; "
          f"{c['redone']} runs redone")


def contention(res: dict[str, Any]) -> dict[str, int]:
    loads: list[float] = []
    redone = 0

    def walk(x: Any) -> None:
        nonlocal redone
        if isinstance(x, dict):
            for k, v in x.items():
                if k.endswith("_load") and isinstance(v, list):
                    loads.extend(v)
                elif k == "discarded_s":
                    redone += len(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(res)
    return {"timed_runs": len(loads), "still_contended": sum(load > 0.05 for load in loads), "redone": redone}


def run(s: Settings, threads: int = THREADS) -> dict[str, Any]:
    torch.set_num_threads(threads)
    assert kernels.cpu_kernels_available(), "the C++ kernels must build for this benchmark"
    gate = QuietGate(s.quiet_budget_s)
    started = datetime.now(UTC).isoformat()
    with torch.inference_mode():
        ops = bench_ops(s, gate)
    model_path = prepare_smollm2()
    llm = LLM(str(model_path), kv_cache_memory_bytes=1 << 30)
    decode = bench_decode(llm, s, gate)
    del llm
    prefill = bench_prefill(model_path, s, gate)
    at_2048 = next(r for r in ops if r["case"] == "paged_decode_attention B=1 ctx=2048")["speedup_vs_ref"]
    res = {
        "benchmark": "kernels_bench", "started": started, "settings": {**s.__dict__, "threads": threads},
        "machine": machine_info(), "code": code_version(), "ops": ops, "decode": decode, "prefill": prefill,
        "targets": {"paged_decode_attention_vs_ref_at_2048": (at_2048, TARGET["paged_decode_attention_vs_ref_at_2048"])},
        "fallbacks": kernels.fallback_counts(),
    }
    res["contention"] = contention(res)
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, N=8 (smoke run)")
    parser.add_argument("--contexts", type=int, nargs="+", help="decode contexts (default 512 2048 8192)")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help=f"torch/OpenMP threads (default {THREADS}; 1 for a smoke run on a busy machine)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/kernels_bench[_quick].json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("workers").setLevel(logging.WARNING)
    s = QUICK if args.quick else FULL
    if args.contexts:
        s = Settings(**{**s.__dict__, "decode_contexts": tuple(args.contexts)})
    out = args.out or REPO_ROOT / "benchmarks" / "results" / ("kernels_bench_quick.json" if args.quick else "kernels_bench.json")
    res = run(s, args.threads)
    print_report(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
