#!/usr/bin/env python
"""Quantized decode: Duet int8 / q4 vs Duet fp32 vs llama.cpp on SmolLM2-135M (same GGUF, same prompts).

Run from the repository root::

    .venv/bin/python benchmarks/quant_decode.py            # full run
    .venv/bin/python benchmarks/quant_decode.py --quick    # smoke run
    make bench-llamacpp-env                                # once, ~15-25 min: the llama.cpp columns

Sides (one at a time, never concurrently, 2 threads each):
    duet-fp32   Duet on the float32 checkpoint (the GGUF de-quantized once, workers/models/assets/prepare.py)
    duet-int8   the same with ``quantization='int8'`` (per-channel int8 weights, fp32 activations, int8 LM head)
    duet-q4     ``quantization='q4'``: the GGUF's own Q4_1 codes repacked (int8 LM head)
    duet-q4-modules  duet-q4 with fused_decode=False: decode steps through the per-layer modules
                instead of the fused C++ decoder stack (the A/B of that optimisation)
    llamacpp-portable / llamacpp-native
                llama-cpp-python 0.3.36 from PyPI, built by benchmarks/llamacpp_env.sh into
                .bench-envs/ (portable: -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                -DGGML_F16C=ON; native: the default -march=native build), on the same Q4_1 GGUF. Each
                measurement runs benchmarks/llamacpp_worker.py in that venv; a crash is recorded as
                such. A missing venv skips the column with a message.

Figures (definitions as in benchmarks/engine_throughput.py):
    batch-1 decode tok/s   (N - 1) / (T_N - median T_1), one ~20-token prompt, N new tokens; median
                           over repeats. Both llama.cpp builds run with n_batch=512 (an earlier report had the
                           native build crashing on batches of 2+ tokens; 0.3.36 did not here, and a
                           crash would be recorded per figure).
    C=k total tok/s        k * N / wall time for k different prompts (10-60 tokens), prefill included.
                           Duet: all k at once (continuous batching). llama.cpp: llama-cpp-python's API
                           runs one sequence at a time, so the k requests go one after another (its
                           HTTP server's parallel slots were not measured).
    prefill tok/s          512 / time to compute a 512-token prompt (Duet: generate 1 token; llama.cpp:
                           Llama.eval).
Contention: the quiet-machine gate of engine_throughput.py (wait for quiet, redo contended runs),
and every kept run's load in the JSON.

Targets: q4 batch-1 decode >= 0.9x llama.cpp (best build); q4 C=32 total tok/s > llama.cpp.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import (  # noqa: E402
    CONTENDED,
    DECODE_PROMPT,
    CpuLoadMeter,
    QuietGate,
    Timing,
    code_version,
    concurrency_prompts,
    first_mismatch,
    machine_info,
    quiet_median,
    record,
)
from workers.llm import LLM  # noqa: E402
from workers.models.assets.prepare import prepare_smollm2  # noqa: E402
from workers.models.checkpoint import SMOLLM2_NAME, gguf_source  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("benchmarks.quant_decode")

THREADS = 2
SAMPLE_TEXT = REPO_ROOT / "tests" / "data" / "public_domain_sample.txt"
LLAMACPP_VARIANTS = ("portable", "native")
TARGETS = {"q4_batch1_vs_llamacpp": 0.9, "q4_c32_vs_llamacpp": 1.0}


@dataclass(frozen=True)
class Settings:
    decode_tokens: int = 128
    decode_repeats: int = 5
    throughput_tokens: int = 64
    throughput_repeats: int = 3
    concurrencies: tuple[int, ...] = (8, 32)
    prefill_tokens: int = 512
    prefill_repeats: int = 3
    quiet_budget_s: float = 300.0


FULL = Settings()
QUICK = Settings(decode_tokens=32, decode_repeats=3, throughput_tokens=16, throughput_repeats=1, prefill_repeats=2,
                 quiet_budget_s=60.0)


# ------------------------------------------------------------------------------ sides
class DuetSide:
    def __init__(self, quantization: str, fused: bool = True) -> None:
        self.name = f"duet-{'fp32' if quantization == 'none' else quantization}{'' if fused else '-modules'}"
        # Prefix caching off: repeats reuse prompts, and llama.cpp recomputes distinct prompts too.
        self.llm = LLM(SMOLLM2_NAME, quantization=quantization, enable_prefix_caching=False,
                       kv_cache_memory_bytes=512 << 20, fused_decode=fused)

    def weight_bytes(self) -> int:
        """Bytes of weights one batch-1 step reads: every parameter and buffer except the embedding
        table, of which one row."""
        model = self.llm.engine.runner.model
        emb = model.model.embed_tokens.weight
        tensors = [*model.parameters(), *model.buffers()]
        total = sum(t.numel() * t.element_size() for t in tensors if t is not emb)
        tied_fp32_head = model.lm_head is None
        return total + emb[0].numel() * emb.element_size() * (1 if not tied_fp32_head else emb.shape[0])

    def timed(self, prompts: list[list[int]], n: int, gate: QuietGate) -> Timing:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = gate.time(lambda: [o.token_ids for o in self.llm.generate(prompts, params)])
        assert all(len(x) == n for x in t.value), f"{self.name}: expected {n} tokens per request"
        return t

    def close(self) -> None:
        del self.llm
        gc.collect()


class _WithChildren(CpuLoadMeter):
    """Load meter that counts a finished child process's CPU time as our own."""

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        busy, own, wall = CpuLoadMeter._sample()
        t = os.times()
        return busy, own + t.children_user + t.children_system, wall


class LlamaCppSide:
    def __init__(self, variant: str, python: Path, gguf: Path) -> None:
        self.name, self.python, self.gguf = f"llamacpp-{variant}", python, gguf

    def _job(self, kind: str, prompts: list[list[int]], n: int, n_batch: int) -> dict[str, Any]:
        job = {"kind": kind, "model": str(self.gguf), "threads": THREADS, "n_batch": n_batch, "prompts": prompts, "n": n}
        proc = subprocess.run([str(self.python), str(REPO_ROOT / "benchmarks" / "llamacpp_worker.py")],
                              input=json.dumps(job), capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return {"crashed": f"exit code {proc.returncode}: {proc.stderr.strip()[-300:]}"}
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def timed(self, prompts: list[list[int]], n: int, gate: QuietGate, kind: str = "generate",
              n_batch: int = 512) -> Timing | str:
        """Like QuietGate.time, with llama.cpp's own timer; a crash returns its message."""
        discarded: list[float] = []
        while True:
            gate.wait()
            meter = _WithChildren()
            out = self._job(kind, prompts, n, n_batch)
            if "crashed" in out:
                return out["crashed"]
            load = meter.read()
            if load <= CONTENDED or len(discarded) == gate.retries or gate.spent_s >= gate.budget_s:
                return Timing(out["seconds"], out["tokens"], load, discarded)
            discarded.append(out["seconds"])
            gate.spent_s += out["seconds"]

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------- measurements
def measure_side(side, s: Settings, decode_ids: list[int], conc: list[list[int]], prefill_ids: list[int],
                 gate: QuietGate) -> dict[str, Any]:
    res: dict[str, Any] = {}
    crash = None

    def run(key: str, d: dict[str, Any], *args, **kw) -> Timing | None:
        nonlocal crash
        t = side.timed(*args, gate=gate, **kw)
        if isinstance(t, str):
            crash = d["crashed"] = t
            return None
        record(d, key, t)
        return t

    dec: dict[str, Any] = {}
    for _ in range(s.decode_repeats):
        t_n = run("t_n", dec, [decode_ids], s.decode_tokens)
        if t_n is None or run("t_1", dec, [decode_ids], 1) is None:
            break
        dec["token_ids"] = t_n.value[0]
    if "t_1" in dec and "t_n" in dec:
        t1 = quiet_median(dec["t_1"], dec["t_1_load"])
        dec["tokens_per_s"] = [(s.decode_tokens - 1) / (t - t1) for t in dec["t_n"]]
        dec["median_tokens_per_s"] = quiet_median(dec["tokens_per_s"], dec["t_n_load"])
    res["batch1_decode"] = dec
    for c in s.concurrencies:
        d: dict[str, Any] = {}
        for _ in range(s.throughput_repeats):
            if run("seconds", d, conc[:c], s.throughput_tokens) is None:
                break
        if "seconds" in d:
            d["median_tokens_per_s"] = quiet_median([c * s.throughput_tokens / x for x in d["seconds"]], d["seconds_load"])
        res[f"c{c}"] = d
    pre: dict[str, Any] = {}
    for _ in range(s.prefill_repeats):
        kw = {"kind": "prefill", "n_batch": 512} if isinstance(side, LlamaCppSide) else {}
        if run("seconds", pre, [prefill_ids], 1 if isinstance(side, DuetSide) else 0, **kw) is None:
            break
    if "seconds" in pre:
        pre["median_tokens_per_s"] = len(prefill_ids) / quiet_median(pre["seconds"], pre["seconds_load"])
    res["prefill"] = pre
    if crash:
        logger.warning("%s crashed: %s", side.name, crash)
    return res


def llamacpp_sides(gguf: Path) -> tuple[list[LlamaCppSide], dict[str, str]]:
    sides, skipped = [], {}
    for v in LLAMACPP_VARIANTS:
        py = REPO_ROOT / ".bench-envs" / f"llamacpp-{v}" / "bin" / "python"
        ok = py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            sides.append(LlamaCppSide(v, py, gguf))
        else:
            skipped[f"llamacpp-{v}"] = (f"{py.parent.parent} has no llama-cpp-python: run `make bench-llamacpp-env` "
                                        "(~15-25 min on 2 cores) for this column")
            logger.warning("skipping llamacpp-%s: %s", v, skipped[f"llamacpp-{v}"])
    return sides, skipped


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def get(side: str, key: str) -> float | None:
        return results.get(side, {}).get(key, {}).get("median_tokens_per_s")

    llama = [n for n in results if n.startswith("llamacpp")]
    best = lambda key: max((v for n in llama if (v := get(n, key)) is not None), default=None)  # noqa: E731
    ratios: dict[str, float] = {}
    for q in ("int8", "q4"):
        for key in ("batch1_decode", "c8", "c32", "prefill"):
            base, mine, peer = get("duet-fp32", key), get(f"duet-{q}", key), best(key)
            if base and mine:
                ratios[f"{q}_{key}_vs_fp32"] = mine / base
            if peer and mine:
                ratios[f"{q}_{key}_vs_llamacpp"] = mine / peer
    for key in ("batch1_decode", "c8", "c32"):
        fused, modules = get("duet-q4", key), get("duet-q4-modules", key)
        if fused and modules:
            ratios[f"q4_{key}_fused_vs_modules"] = fused / modules
    targets = {"q4_batch1_vs_llamacpp": ratios.get("q4_batch1_decode_vs_llamacpp"),
               "q4_c32_vs_llamacpp": ratios.get("q4_c32_vs_llamacpp")}
    met = {k: (v is not None and v >= TARGETS[k]) if v is not None else None for k, v in targets.items()}
    return {"ratios": ratios, "targets": TARGETS, "targets_met": met}


def print_report(res: dict[str, Any]) -> None:
    sides = res["results"]
    print(f"\n== quantized decode, {SMOLLM2_NAME}, {THREADS} threads; code {(res['code']['commit'] or '?')[:10]} ==")
    cols = ["batch1_decode", "c8", "c32", "prefill"]
    rows = [("side", "weights MB/tok", "batch-1 tok/s", "C=8 tok/s", "C=32 tok/s", "prefill-512 tok/s", "quiet runs")]
    for name, r in sides.items():
        vals = [r.get(k, {}).get("median_tokens_per_s") for k in cols]
        loads = [x for k in cols for key, v in r.get(k, {}).items() if key.endswith("_load") for x in v]
        mb = res["weight_bytes_per_token"].get(name)
        cells = ["crash" if v is None and "crashed" in r.get(k, {}) else f"{v:.1f}" if v else "-"
                 for k, v in zip(cols, vals)]
        rows.append((name, f"{mb / 1e6:.0f}" if mb else "-", *cells, f"{sum(x <= CONTENDED for x in loads)}/{len(loads)}"))
    for name in res["skipped"]:
        rows.append((name, "-", "skipped", "", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for name, r in sides.items():
        for k in cols:
            if "crashed" in r.get(k, {}):
                print(f"{name} {k}: crashed ({r[k]['crashed'][:120]})")
    for name, why in res["skipped"].items():
        print(f"{name}: {why}")
    print("ratios:", ", ".join(f"{k} {v:.2f}x" for k, v in res["summary"]["ratios"].items()))
    print("targets met:", res["summary"]["targets_met"], "| greedy agreement:", res["greedy_agreement"])
    print(f"noise: whole-run others' CPU share {res['contention']['whole_run_load']:.0%}, "
          f"{res['contention']['quiet_budget_spent_s']:.0f} s spent waiting for quiet / redoing")


def run(settings: Settings) -> dict[str, Any]:
    wall0, whole, gate = time.perf_counter(), CpuLoadMeter(), QuietGate(settings.quiet_budget_s)
    torch.set_num_threads(THREADS)
    path = prepare_smollm2()
    gguf = gguf_source(path)
    if gguf is None:
        raise SystemExit(f"{path} has no GGUF source beside it (the llama.cpp sides and the q4 weights read it)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    decode_ids = tok(DECODE_PROMPT)["input_ids"]
    conc = [tok(p)["input_ids"] for p in concurrency_prompts(tok, max(settings.concurrencies))]
    prefill_ids = tok(SAMPLE_TEXT.read_text())["input_ids"][: settings.prefill_tokens]
    assert len(prefill_ids) == settings.prefill_tokens
    res: dict[str, Any] = {"timestamp": datetime.now(UTC).isoformat(), "model": SMOLLM2_NAME,
                           "gguf": str(gguf), "settings": asdict(settings), "machine": machine_info(),
                           "code": code_version(), "results": {}, "weight_bytes_per_token": {}}
    llama, res["skipped"] = llamacpp_sides(gguf)
    for q, fused in (("none", True), ("int8", True), ("q4", True), ("q4", False)):
        side = DuetSide(q, fused)
        logger.info("measuring %s", side.name)
        res["weight_bytes_per_token"][side.name] = side.weight_bytes()
        side.timed([decode_ids], 4, gate)  # warm-up
        res["results"][side.name] = measure_side(side, settings, decode_ids, conc, prefill_ids, gate)
        side.close()
    for peer_side in llama:
        logger.info("measuring %s", peer_side.name)
        res["results"][peer_side.name] = measure_side(peer_side, settings, decode_ids, conc, prefill_ids, gate)
    ref = res["results"]["duet-fp32"]["batch1_decode"].get("token_ids", [])
    res["greedy_agreement"] = {n: first_mismatch(ref, r["batch1_decode"]["token_ids"])
                               for n, r in res["results"].items() if n != "duet-fp32" and "token_ids" in r["batch1_decode"]}
    res["summary"] = summarize(res["results"])
    res["contention"] = {"whole_run_load": whole.read(), "quiet_budget_spent_s": gate.spent_s, "threshold": CONTENDED}
    res["wall_time_s"] = time.perf_counter() - wall0
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke run)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/quant_decode[_quick].json)")
    parser.add_argument("--quiet-budget", type=float, help="seconds to spend waiting for quiet / redoing runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("workers").setLevel(logging.WARNING)
    settings = QUICK if args.quick else FULL
    if args.quiet_budget is not None:
        settings = replace(settings, quiet_budget_s=args.quiet_budget)
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"quant_decode{'_quick' if args.quick else ''}.json"
    res = run(settings)
    print_report(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
