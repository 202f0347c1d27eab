#!/usr/bin/env python
"""Duet vs plain Hugging Face transformers on CPU: batch-1 decode, roofline, concurrent throughput.

Run from the repository root::

    .venv/bin/python benchmarks/engine_throughput.py            # full run
    .venv/bin/python benchmarks/engine_throughput.py --quick    # smoke run (N=32, fewer repeats)
    make bench ARGS=--quick

Everything runs in ONE process, one side at a time (never concurrently), with
``torch.set_num_threads(2)``, SmolLM2-135M-Instruct in float32, greedy decoding, and the same
prompt token ids and output lengths for both sides.

Definitions
    weight-streaming bandwidth  bytes of weights / seconds for fp32 GEMVs ``x[1, K] @ W[N, K]^T``
        whose matrices do not fit in the last-level cache; median of repeats. Two flavours:
        * synthetic: one 512 MiB matrix (N=32768, K=4096), several times the L3;
        * model-shaped: one sweep over the HF model's own matrices in execution order (every
          nn.Linear of all layers, then the LM head), i.e. exactly the GEMVs of one batch-1 decode
          step; ~540 MB per sweep, so no matrix is still cached when its turn comes again.
    bytes per token  weight bytes one batch-1 decode step reads, counted from the model's
        parameters: all linear weights of all layers + the LM head (tied to the embedding for
        SmolLM2: 49152 x 576) + norm weights + ONE embedding row (the lookup reads one row).
        KV-cache reads are not counted (~1% at these context lengths).
    roofline  max(synthetic, model-shaped bandwidth) / bytes per token, in tokens/s: the batch-1
        decode speed of an engine that did nothing but stream its weights once per token.
    batch-1 decode tokens/s  (N - 1) / (T_N - T_1), with T_k the wall time of one generate call
        producing k new tokens for a ~20-token prompt: subtracting T_1 removes prefill and per-call
        overhead. T_1 is the median of all T_1 runs of that side (one per repeat); the figure is the
        median over repeats of the T_N runs.
    throughput at concurrency C  C * N / T, with T the wall time for C different prompts
        (10-60 tokens) each producing exactly N tokens, prefill included. Duet gets all C prompts
        at once (continuous batching); HF gets one left-padded batch of the same C prompts.
        Median over repeats.

Fairness: tokenization happens before the clock starts and both sides get the same ids; Duet has
prefix caching off, so repeated prompts are really recomputed (HF keeps no cache between calls);
EOS cannot end a request early (Duet ``ignore_eos``, HF ``min_new_tokens``); each side is warmed
up once per shape; repeats alternate which side goes first. Greedy tokens of the batch-1 run are
compared between the sides (a mismatch is a warning, not a failure).

Shared machines: with 2 threads on 2 cores, any other busy process (or hypervisor steal) makes
times 2-10x worse. Each timed run waits for a quiet machine first, measures the CPU share others
took meanwhile, and is redone (up to twice) if that share was over 5%, within a total budget
(``--quiet-budget``). Medians are taken over the kept runs that were not contended (over all of
them if none was quiet); every raw timing, its load and every redone attempt are in the JSON, and
the printout counts redone and still-contended runs.

Targets: batch-1 decode >= 2x HF and >= 60% of the roofline; 32 concurrent >= 1.5x HF.

Per-dtype mode (``--dtypes fp32 bf16 int8 q4``, no HF side, no bandwidth part): Duet's offline
engine alone, throughput at each ``--concurrency`` (default 1 8 32 64) as defined above, for each
dtype in turn (bf16: ``dtype='bfloat16'``; int8 / q4: ``quantization=...`` with float32
activations quantized to int8 in the kernels), with ``--threads`` torch threads (default 1 in this
mode), the same prompts for every dtype; all dtypes' engines are loaded at once and take turns
within each round of repeats (alternating order), so a busy neighbour slows them alike; ratios vs
fp32 in the same run, and each dtype's greedy outputs compared with fp32's (identical sequences). JSON:
benchmarks/results/engine_throughput_dtypes[_quick].json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # runnable as a plain script from anywhere

from workers.llm import LLM  # noqa: E402
from workers.models.assets.prepare import prepare_smollm2  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("benchmarks.engine_throughput")

MODEL = "SmolLM2-135M-Instruct"
THREADS = 2
SYNTHETIC_SHAPE = (32768, 4096)  # [N, K] fp32 = 512 MiB
CONTENDED = 0.05  # others' share of the CPU above which a timed run is redone / flagged
TARGETS = {"batch1_decode_vs_hf": 2.0, "batch1_decode_vs_roofline": 0.60, "c32_throughput_vs_hf": 1.5}
DECODE_PROMPT = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"
# Prompts for the concurrency runs are token windows of this passage: deterministic, natural text.
PASSAGE = (
    "Rivers shape the land they cross. Over thousands of years a river carves valleys, deposits silt "
    "on its floodplain and builds deltas where it meets the sea. Early farming villages grew along "
    "rivers such as the Nile, the Tigris and the Yangtze, because the yearly floods left fertile soil "
    "behind. Engineers later learned to tame these floods with levees, canals and dams, trading the "
    "free fertiliser of the flood for reliable water and electricity. A modern hydroelectric dam "
    "turns the potential energy of stored water into electrical power with turbines that can reach "
    "an efficiency above ninety percent. Yet dams also trap sediment, so deltas downstream slowly "
    "shrink and coastlines retreat. Fish that migrate upstream to spawn, like salmon and sturgeon, "
    "need ladders or lifts to pass the barrier. Ecologists now study how to restore natural flow "
    "regimes: releasing water in pulses that imitate spring floods, removing small obsolete dams, "
    "and reconnecting side channels to the main stream. Cities are rediscovering their rivers too. "
    "Paths replace old warehouses, and people swim again in water that was too polluted a generation "
    "ago. The story of a river is therefore a story of trade-offs between people, energy, food and the "
    "many creatures that depend on moving water. Understanding those trade-offs requires data: flow "
    "gauges, satellite images of sediment plumes, and long records of rainfall across the basin."
)


@dataclass(frozen=True)
class Settings:
    """decode_tokens: N of the batch-1 decode run; throughput_tokens: N per request at concurrency C."""

    decode_tokens: int
    throughput_tokens: int
    decode_repeats: int
    throughput_repeats: int
    concurrencies: tuple[int, ...] = (1, 8, 32)
    bandwidth_repeats: int = 9
    quiet_budget_s: float = 240.0  # total seconds to spend waiting for quiet / redoing runs, see QuietGate


FULL = Settings(decode_tokens=128, throughput_tokens=128, decode_repeats=5, throughput_repeats=3)
QUICK = Settings(decode_tokens=32, throughput_tokens=32, decode_repeats=3, throughput_repeats=2, quiet_budget_s=60.0)


# ------------------------------------------------------------ machine, noise
def machine_info() -> dict[str, Any]:
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    return {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "transformers_version": __import__("transformers").__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def code_version() -> dict[str, Any]:
    """The commit measured, and whether the working tree had uncommitted changes (the engine moves)."""

    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.splitlines()

    changed = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no")]  # "XY path"
    return {"commit": next(iter(git("rev-parse", "HEAD")), None), "uncommitted_changes": changed}


class CpuLoadMeter:
    """Share of the machine's CPU time taken by others (other processes + hypervisor steal) since
    the meter started; this process's own threads are subtracted. 0.5 = one of two cores."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        t = os.times()
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        return busy, t.user + t.system, time.monotonic()

    def read(self) -> float:
        (busy0, own0, wall0), (busy1, own1, wall1) = self._start, self._sample()
        cpus = os.cpu_count() or 1
        # /proc/stat counts in clock ticks (10 ms): forgive one tick per CPU of accounting error,
        # or every 0.1 s run would look contended by a single stray kernel-thread tick.
        others = (busy1 - busy0) - (own1 - own0) - cpus / os.sysconf("SC_CLK_TCK")
        return max(0.0, others) / (max(wall1 - wall0, 1e-9) * cpus)


@dataclass
class Timing:
    seconds: float
    value: Any  # what the timed function returned
    load: float  # others' CPU share during the kept run
    discarded: list[float] = field(default_factory=list)  # seconds of redone (contended) attempts


class QuietGate:
    """Times a function on a quiet machine: waits (at most 20 s) until others used < 5% of the CPU
    over 0.25 s, times the call, and redoes it (at most twice) if others took > CONTENDED of the CPU
    meanwhile. Waiting and redone runs draw on one budget for the whole benchmark; once it is spent,
    runs are timed as they come (and still flagged by their load), so a busy machine cannot stall
    the benchmark."""

    def __init__(self, budget_s: float, max_wait_s: float = 20.0, retries: int = 2) -> None:
        self.budget_s, self.max_wait_s, self.retries = budget_s, max_wait_s, retries
        self.spent_s = 0.0

    def wait(self) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < min(self.max_wait_s, self.budget_s - self.spent_s):
            meter = CpuLoadMeter()
            time.sleep(0.25)
            if meter.read() < 0.05:
                break
        self.spent_s += time.monotonic() - t0

    def time(self, fn: Callable[[], Any]) -> Timing:
        discarded: list[float] = []
        while True:
            gc.collect()
            self.wait()
            meter = CpuLoadMeter()
            t0 = time.perf_counter()
            value = fn()
            seconds = time.perf_counter() - t0
            load = meter.read()
            if load <= CONTENDED or len(discarded) == self.retries or self.spent_s >= self.budget_s:
                return Timing(seconds, value, load, discarded)
            discarded.append(seconds)
            self.spent_s += seconds


def record(d: dict[str, Any], key: str, t: Timing, scale: float = 1.0) -> None:
    """Append a timing's seconds * scale to d[key], its load to d[key + "_load"], and its discarded
    attempts to d["discarded_s"]."""
    d.setdefault(key, []).append(t.seconds * scale)
    d.setdefault(f"{key}_load", []).append(t.load)
    d.setdefault("discarded_s", []).extend(s * scale for s in t.discarded)


def quiet_median(values: list[float], loads: list[float]) -> float:
    """Median over the runs that were not contended; over all runs if every run was."""
    quiet = [v for v, load in zip(values, loads) if load <= CONTENDED]
    return statistics.median(quiet or values)


# --------------------------------------------------------------- bandwidth
@torch.inference_mode()
def gemv_bandwidth(weights: list[torch.Tensor], repeats: int, gate: QuietGate) -> dict[str, Any]:
    """One sweep = x[1, K] @ W^T for every W in order; GB/s = bytes of all W / sweep time."""
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def sweep() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    sweep()  # warm-up: faults pages in, lets the BLAS pick its kernels
    # One repeat = k back-to-back sweeps (>= ~0.3 s), long enough for the load meter to resolve.
    k = max(1, round(0.3 / gate.time(sweep).seconds))

    def sweeps() -> None:
        for _ in range(k):
            sweep()

    nbytes = sum(w.numel() * w.element_size() for w in weights)
    res: dict[str, Any] = {"bytes": nbytes, "num_matrices": len(weights), "sweeps_per_repeat": k}
    for _ in range(repeats):
        record(res, "seconds", gate.time(sweeps), scale=1 / k)  # seconds per sweep
    res["median_gbps"] = nbytes / quiet_median(res["seconds"], res["seconds_load"]) / 1e9
    res["best_gbps"] = nbytes / min(res["seconds"]) / 1e9
    return res


def synthetic_bandwidth(repeats: int, gate: QuietGate) -> dict[str, Any]:
    n, k = SYNTHETIC_SHAPE
    w = torch.empty(n, k).uniform_(-1, 1)  # written, so every page is real (calloc'd zeros would not be)
    try:
        return {"shape": [n, k], **gemv_bandwidth([w], repeats, gate)}
    finally:
        del w
        gc.collect()


def streamed_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The matrices one batch-1 decode step streams, in execution order (layers, then LM head)."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def bytes_per_token(model: Any) -> dict[str, Any]:  # a transformers PreTrainedModel
    """Weight bytes read by one batch-1 decode step, from the model's actual parameters."""
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings().weight  # [V, E]
    tied = head.weight.data_ptr() == embed.data_ptr()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    layer_linear = sum(nbytes(p) for m in linears for p in m.parameters(recurse=False))
    lm_head = sum(nbytes(p) for p in head.parameters(recurse=False))
    total_params = sum(nbytes(p) for p in model.parameters())  # shared (tied) parameters count once
    # What is neither a linear layer, the LM head nor the embedding table: the norm weights.
    other = total_params - layer_linear - lm_head - (0 if tied else nbytes(embed))
    row = embed[0].numel() * embed.element_size()
    return {
        "layer_linear_bytes": layer_linear,
        "lm_head_bytes": lm_head,
        "lm_head_tied_to_embedding": tied,
        "embedding_row_bytes": row,
        "norm_and_other_bytes": other,
        "total_bytes": layer_linear + lm_head + row + other,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def roofline(bw: dict[str, Any], per_token: dict[str, Any]) -> dict[str, Any]:
    syn, shaped = bw["synthetic"]["median_gbps"], bw["model_shaped"]["median_gbps"]
    nbytes = per_token["total_bytes"]
    return {
        "bandwidth_gbps": max(syn, shaped),
        "bytes_per_token": nbytes,
        "tokens_per_s": max(syn, shaped) * 1e9 / nbytes,
        "tokens_per_s_synthetic_bw": syn * 1e9 / nbytes,
        "tokens_per_s_model_shaped_bw": shaped * 1e9 / nbytes,
    }


# ----------------------------------------------------------------- runners
class DuetRunner:
    name = "duet"

    def __init__(self, llm: LLM, tokenizer: Any) -> None:
        self.llm, self.tokenizer = llm, tokenizer

    def prepare(self, prompts: list[str]) -> list[list[int]]:
        return self.tokenizer(prompts)["input_ids"]  # ids: tokenizing stays out of the timed region

    def generate(self, inputs: list[list[int]], n: int) -> list[list[int]]:
        outs = self.llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert all(o.num_cached_tokens == 0 for o in outs), "prefix cache hit: unfair against HF"
        return [o.token_ids for o in outs]


class HFRunner:
    name = "hf"

    def __init__(self, model: Any, tokenizer: Any) -> None:  # a transformers PreTrainedModel
        self.model, self.tokenizer = model, tokenizer

    def prepare(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return self.tokenizer(prompts, padding=True, return_tensors="pt")  # left-padded batch

    def generate(self, inputs: dict[str, torch.Tensor], n: int) -> list[list[int]]:
        out = self.model.generate(
            **inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
        )  # [B, P + n]
        return out[:, inputs["input_ids"].shape[1] :].tolist()


def timed_generate(runner, inputs, n: int, gate: QuietGate) -> Timing:
    """One timed generate call; checks every request produced exactly n tokens."""
    t = gate.time(lambda: runner.generate(inputs, n))
    assert all(len(toks) == n for toks in t.value), f"{runner.name}: expected {n} tokens per request"
    return t


def prepare_all(runners: list, prompts: list[str]) -> dict[str, Any]:
    """Each side's inputs for the same prompts; asserts both sides get the same token ids."""
    inputs = {r.name: r.prepare(prompts) for r in runners}
    batch = inputs["hf"]
    unpadded = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert unpadded == inputs["duet"], "Duet and HF must see the same prompt token ids"
    return inputs


def alternating(runners: list, rep: int) -> list:
    """Repeat rep runs the sides in order A, B if rep is even, else B, A."""
    return runners if rep % 2 == 0 else runners[::-1]


# ------------------------------------------------------------ measurements
def measure_decode(runners: list, prompt: str, n: int, repeats: int, gate: QuietGate) -> dict[str, Any]:
    """Batch-1 decode tokens/s = (n - 1) / (T_n - median T_1), per repeat; median over repeats."""
    inputs = prepare_all(runners, [prompt])
    res: dict[str, Any] = {r.name: {} for r in runners}
    for runner in runners:  # warm-up; its tokens are the reference output
        warm = timed_generate(runner, inputs[runner.name], n, gate)
        res[runner.name].update(warmup_s=warm.seconds, token_ids=warm.value[0])
    for rep in range(repeats):
        for runner in alternating(runners, rep):
            d = res[runner.name]
            t_n = timed_generate(runner, inputs[runner.name], n, gate)
            record(d, "t_n", t_n)
            record(d, "t_1", timed_generate(runner, inputs[runner.name], 1, gate))
            if t_n.value[0] != d["token_ids"]:
                logger.warning("%s: greedy output changed between repeats", runner.name)
    for d in res.values():
        d["t_1_median"] = quiet_median(d["t_1"], d["t_1_load"])
        d["tokens_per_s"] = [(n - 1) / (t - d["t_1_median"]) for t in d["t_n"]]
        d["median_tokens_per_s"] = quiet_median(d["tokens_per_s"], d["t_n_load"])
    return {"prompt": prompt, "prompt_tokens": len(inputs["duet"][0]), "new_tokens": n, **res}


def measure_throughput(runners: list, prompts: list[str], n: int, repeats: int, gate: QuietGate) -> dict[str, Any]:
    """Total output tokens/s for len(prompts) concurrent requests of n tokens each, prefill included."""
    c = len(prompts)
    inputs = prepare_all(runners, prompts)
    res: dict[str, Any] = {r.name: {} for r in runners}
    tokens: dict[str, list[list[int]]] = {}
    for runner in runners:  # warm-up at this batch shape
        res[runner.name]["warmup_s"] = timed_generate(runner, inputs[runner.name], 4, gate).seconds
    for rep in range(repeats):
        for runner in alternating(runners, rep):
            t = timed_generate(runner, inputs[runner.name], n, gate)
            record(res[runner.name], "seconds", t)
            tokens[runner.name] = t.value
    for d in res.values():
        d["tokens_per_s"] = [c * n / s for s in d["seconds"]]
        d["median_tokens_per_s"] = quiet_median(d["tokens_per_s"], d["seconds_load"])
    same = sum(a == b for a, b in zip(tokens["duet"], tokens["hf"]))
    return {"concurrency": c, "new_tokens_per_request": n, "prompt_lengths": [len(p) for p in inputs["duet"]],
            "identical_outputs": same, **res}


def concurrency_prompts(tokenizer: Any, count: int) -> list[str]:
    """count different prompts: token windows of PASSAGE, lengths cycling through 10..60 tokens."""
    ids = tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    prompts = []
    for i in range(count):
        length = 10 + (i * 23) % 51  # 10, 33, 56, 28, 51, 23, ... (all in [10, 60])
        start = (i * 37) % (len(ids) - length)
        prompts.append(tokenizer.decode(ids[start : start + length]))
    assert len(set(prompts)) == count, "prompts must differ"
    return prompts


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return diffs[0] if diffs else (None if len(a) == len(b) else min(len(a), len(b)))


# ----------------------------------------------------------------- summary
def summarize(roof: dict[str, Any], decode: dict[str, Any], tput: dict[int, dict]) -> dict[str, Any]:
    duet, hf = decode["duet"]["median_tokens_per_s"], decode["hf"]["median_tokens_per_s"]
    ratios = {
        "batch1_decode_vs_hf": duet / hf,
        "batch1_decode_vs_roofline": duet / roof["tokens_per_s"],
        "hf_batch1_decode_vs_roofline": hf / roof["tokens_per_s"],
        "batch1_decode_vs_model_shaped_roofline": duet / roof["tokens_per_s_model_shaped_bw"],
        "hf_batch1_decode_vs_model_shaped_roofline": hf / roof["tokens_per_s_model_shaped_bw"],
        **{f"c{c}_throughput_vs_hf": t["duet"]["median_tokens_per_s"] / t["hf"]["median_tokens_per_s"]
           for c, t in tput.items()},
    }
    return {"ratios": ratios, "targets": TARGETS,
            "targets_met": {k: ratios[k] >= v for k, v in TARGETS.items() if k in ratios}}


def contention(res: dict[str, Any], gate: QuietGate, whole_run: CpuLoadMeter) -> dict[str, Any]:
    """How much others competed with the timed runs that were kept, and how many were redone."""
    sections = [res["bandwidth"]["synthetic"], res["bandwidth"]["model_shaped"],
                *(res["batch1_decode"][side] for side in ("duet", "hf")),
                *(t[side] for t in res["throughput"].values() for side in ("duet", "hf"))]
    loads = [x for s in sections for key, v in s.items() if key.endswith("_load") for x in v]
    return {"kept_runs": len(loads), "contended_kept_runs": sum(x > CONTENDED for x in loads),
            "redone_runs": sum(len(s["discarded_s"]) for s in sections), "threshold": CONTENDED,
            "max_load_kept": max(loads), "quiet_budget_spent_s": gate.spent_s, "whole_run_load": whole_run.read()}


def print_report(res: dict[str, Any]) -> None:
    m, bw, roof, dec = res["machine"], res["bandwidth"], res["roofline"], res["batch1_decode"]
    pt, ratios, met = res["bytes_per_token"], res["summary"]["ratios"], res["summary"]["targets_met"]
    syn, shaped = bw["synthetic"], bw["model_shaped"]
    print(f"\n== Duet vs HF transformers: {MODEL} fp32, greedy, {m['torch_num_threads']} threads ==")
    print(f"machine: {m['cpu_model']}, {m['logical_cpus']} CPUs, torch {m['torch_version']}, "
          f"transformers {m['transformers_version']}; code {(res['code']['commit'] or '?')[:10]}"
          + (f" + {len(res['code']['uncommitted_changes'])} uncommitted files" if res["code"]["uncommitted_changes"] else ""))
    print(f"weight-streaming bandwidth (median): synthetic GEMV {syn['median_gbps']:.1f} GB/s "
          f"({syn['bytes'] / 2**20:.0f} MiB); model-shaped {shaped['median_gbps']:.1f} GB/s "
          f"({shaped['num_matrices']} matrices, {shaped['bytes'] / 1e6:.0f} MB)")
    print(f"bytes/token: {pt['total_bytes'] / 1e6:.1f} MB (layers {pt['layer_linear_bytes'] / 1e6:.1f} + "
          f"LM head {pt['lm_head_bytes'] / 1e6:.1f} + norms {pt['norm_and_other_bytes'] / 1e3:.0f} kB + "
          f"1 embedding row) -> roofline {roof['tokens_per_s']:.1f} tok/s at {roof['bandwidth_gbps']:.1f} GB/s "
          f"(model-shaped: {roof['tokens_per_s_model_shaped_bw']:.1f} tok/s)")

    def target(key: str, fmt: str) -> tuple[str, str]:
        if key not in TARGETS:
            return "", ""
        goal = f"{TARGETS[key]:.0%}" if fmt == "%" else f"{TARGETS[key]:.1f}x"
        return f">= {goal}", "yes" if met[key] else "NO"

    def quiet(section: dict[str, Any], load_key: str) -> str:
        """'quiet/total' runs behind each side's median, Duet then HF."""
        return " ".join(f"{sum(x <= CONTENDED for x in section[s][load_key])}/{len(section[s][load_key])}"
                        for s in ("duet", "hf"))

    rows = [("metric", "Duet", "HF", "Duet/HF", "target", "met", "quiet runs D H"),
            (f"batch-1 decode tok/s (N={dec['new_tokens']})", f"{dec['duet']['median_tokens_per_s']:.1f}",
             f"{dec['hf']['median_tokens_per_s']:.1f}", f"{ratios['batch1_decode_vs_hf']:.2f}x",
             *target("batch1_decode_vs_hf", "x"), quiet(dec, "t_n_load")),
            ("  fraction of roofline", f"{ratios['batch1_decode_vs_roofline']:.1%}",
             f"{ratios['hf_batch1_decode_vs_roofline']:.1%}", "", *target("batch1_decode_vs_roofline", "%"), ""),
            ("  fraction of model-shaped roofline", f"{ratios['batch1_decode_vs_model_shaped_roofline']:.1%}",
             f"{ratios['hf_batch1_decode_vs_model_shaped_roofline']:.1%}", "", "", "", "")]
    for c, t in res["throughput"].items():
        key = f"c{c}_throughput_vs_hf"
        rows.append((f"C={c} total out tok/s (N={t['new_tokens_per_request']})",
                     f"{t['duet']['median_tokens_per_s']:.1f}", f"{t['hf']['median_tokens_per_s']:.1f}",
                     f"{ratios[key]:.2f}x", *target(key, "x"), quiet(t, "seconds_load")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    check, cont = res["correctness"], res["contention"]
    print(f"batch-1 greedy tokens identical: {check['batch1_tokens_identical']}"
          + ("" if check["batch1_tokens_identical"] else f" (first mismatch at token {check['first_mismatch']})")
          + "; concurrent runs, identical sequences: "
          + ", ".join(f"C={c}: {t['identical_outputs']}/{c}" for c, t in res["throughput"].items()))
    print(f"noise: {cont['redone_runs']} timed runs redone, {cont['contended_kept_runs']}/{cont['kept_runs']} kept "
          f"runs contended (others > {cont['threshold']:.0%} CPU); wall time {res['wall_time_s']:.0f} s, of which "
          f"{cont['quiet_budget_spent_s']:.0f} s waiting for quiet / redoing contended runs")


# -------------------------------------------------------------------- main
def load_hf(path: Path) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer


def run(settings: Settings) -> dict[str, Any]:
    wall0, whole_run, gate = time.perf_counter(), CpuLoadMeter(), QuietGate(settings.quiet_budget_s)
    torch.set_num_threads(THREADS)
    res: dict[str, Any] = {"timestamp": datetime.now(UTC).isoformat(), "model": MODEL,
                           "dtype": "float32", "settings": asdict(settings), "machine": machine_info(),
                           "code": code_version()}
    logger.info("synthetic GEMV bandwidth (%d x %d fp32)", *SYNTHETIC_SHAPE)
    bw = {"synthetic": synthetic_bandwidth(settings.bandwidth_repeats, gate)}
    hf_model, tokenizer = load_hf(prepare_smollm2())
    logger.info("model-shaped GEMV bandwidth")
    bw["model_shaped"] = gemv_bandwidth(streamed_matrices(hf_model), settings.bandwidth_repeats, gate)
    per_token = bytes_per_token(hf_model)
    res.update(bandwidth=bw, bytes_per_token=per_token, roofline=roofline(bw, per_token))

    # Prefix caching off: HF recomputes every prompt, so Duet must too (repeats reuse prompts).
    llm = LLM(MODEL, dtype="float32", enable_prefix_caching=False)
    cfg = llm.engine.config
    res["duet_config"] = {"enable_prefix_caching": cfg.cache.enable_prefix_caching,
                          "kv_cache_memory_bytes": cfg.cache.kv_cache_memory_bytes, **asdict(cfg.scheduler)}
    runners = [DuetRunner(llm, tokenizer), HFRunner(hf_model, tokenizer)]
    try:
        logger.info("batch-1 decode, N=%d", settings.decode_tokens)
        decode = measure_decode(runners, DECODE_PROMPT, settings.decode_tokens, settings.decode_repeats, gate)
        prompts = concurrency_prompts(tokenizer, max(settings.concurrencies))
        tput = {}
        for c in settings.concurrencies:
            logger.info("throughput: concurrency %d, N=%d", c, settings.throughput_tokens)
            tput[c] = measure_throughput(runners, prompts[:c], settings.throughput_tokens,
                                         settings.throughput_repeats, gate)
    finally:
        del runners, hf_model, llm
        gc.collect()

    mismatch = first_mismatch(decode["duet"]["token_ids"], decode["hf"]["token_ids"])
    if mismatch is not None:
        logger.warning("batch-1 greedy tokens differ between Duet and HF from token %d", mismatch)
    res.update(batch1_decode=decode, throughput=tput,
               correctness={"batch1_tokens_identical": mismatch is None, "first_mismatch": mismatch},
               summary=summarize(res["roofline"], decode, tput))
    res["contention"] = contention(res, gate, whole_run)
    res["wall_time_s"] = time.perf_counter() - wall0
    if res["contention"]["contended_kept_runs"]:
        logger.warning("%d timed runs shared the CPU with other processes even after retries: rerun",
                       res["contention"]["contended_kept_runs"])
    return res


DTYPE_CONFIGS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
                 "int8": {"dtype": "float32", "quantization": "int8"}, "q4": {"dtype": "float32", "quantization": "q4"}}


def run_dtypes(settings: Settings, dtypes: list[str], threads: int) -> dict[str, Any]:
    """Offline engine throughput per dtype at each concurrency (see the module docstring)."""
    from transformers import AutoTokenizer

    wall0, whole_run, gate = time.perf_counter(), CpuLoadMeter(), QuietGate(settings.quiet_budget_s)
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    prompts = concurrency_prompts(tokenizer, max(settings.concurrencies))
    ids = tokenizer(prompts)["input_ids"]
    n = settings.throughput_tokens
    res: dict[str, Any] = {"timestamp": datetime.now(UTC).isoformat(), "model": MODEL, "threads": threads,
                           "settings": asdict(settings), "machine": machine_info(), "code": code_version(),
                           "loadavg_start": os.getloadavg(), "dtypes": {}}
    outputs: dict[str, dict[int, list[list[int]]]] = {name: {} for name in dtypes}
    runners = {name: DuetRunner(LLM(MODEL, enable_prefix_caching=False, **DTYPE_CONFIGS[name]), tokenizer)
               for name in dtypes}  # all loaded at once (~0.6 GB each), so the dtypes can take turns
    for name in dtypes:
        res["dtypes"][name] = {"config": DTYPE_CONFIGS[name], "resolved_dtype": runners[name].llm.engine.config.dtype,
                               "throughput": {}}
    try:
        for c in settings.concurrencies:
            rows: dict[str, dict[str, Any]] = {name: {"warmup_s": timed_generate(runners[name], ids[:c], 4, gate).seconds} for name in dtypes}
            for rep in range(settings.throughput_repeats):
                # each round times every dtype once, in alternating order, so load from other processes
                # falls on all of them alike
                for name in dtypes if rep % 2 == 0 else dtypes[::-1]:
                    logger.info("%s: concurrency %d, N=%d, %d thread(s), repeat %d", name, c, n, threads, rep)
                    t = timed_generate(runners[name], ids[:c], n, gate)
                    record(rows[name], "seconds", t)
                    outputs[name][c] = t.value
            for name, d in rows.items():
                d["tokens_per_s"] = [c * n / sec for sec in d["seconds"]]
                d["median_tokens_per_s"] = quiet_median(d["tokens_per_s"], d["seconds_load"])
                res["dtypes"][name]["throughput"][c] = d
    finally:
        del runners
        gc.collect()
    if "fp32" in outputs:
        for name in dtypes:
            for c, d in res["dtypes"][name]["throughput"].items():
                d["vs_fp32"] = d["median_tokens_per_s"] / res["dtypes"]["fp32"]["throughput"][c]["median_tokens_per_s"]
                d["identical_outputs_vs_fp32"] = sum(a == b for a, b in zip(outputs[name][c], outputs["fp32"][c]))
    loads = [x for v in res["dtypes"].values() for d in v["throughput"].values() for x in d["seconds_load"]]
    res["contention"] = {"kept_runs": len(loads), "contended_kept_runs": sum(x > CONTENDED for x in loads),
                         "threshold": CONTENDED, "quiet_budget_spent_s": gate.spent_s,
                         "whole_run_load": whole_run.read()}
    res["loadavg_end"] = os.getloadavg()
    res["wall_time_s"] = time.perf_counter() - wall0
    return res


def print_dtypes_report(res: dict[str, Any]) -> None:
    cs = list(next(iter(res["dtypes"].values()))["throughput"])
    print(f"\n== Duet offline engine, total output tok/s (N={res['settings']['throughput_tokens']}), "
          f"{res['threads']} thread(s); load {res['loadavg_start']} -> {res['loadavg_end']} ==")
    print("dtype  " + "".join(f"{f'C={c}':>16}" for c in cs))
    for name, v in res["dtypes"].items():
        cells = []
        for c in cs:
            d = v["throughput"][c]
            ratio = f" ({d['vs_fp32']:.2f}x)" if "vs_fp32" in d else ""
            cells.append(f"{d['median_tokens_per_s']:.1f}{ratio}")
        print(f"{name:<7}" + "".join(f"{x:>16}" for x in cells))
    cont = res["contention"]
    print(f"noise: {cont['contended_kept_runs']}/{cont['kept_runs']} kept runs contended "
          f"(others > {cont['threshold']:.0%} CPU); wall time {res['wall_time_s']:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=32 and fewer repeats (smoke run)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/engine_throughput[_quick].json)")
    parser.add_argument("--quiet-budget", type=float,
                        help="total seconds to spend waiting for a quiet machine and redoing contended runs")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPE_CONFIGS),
                        help="per-dtype mode: Duet alone at each --concurrency for these dtypes (no HF side)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="concurrencies of the per-dtype mode (default 1 8 32 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the per-dtype mode (default 1)")
    parser.add_argument("--repeats", type=int, help="timed runs per dtype and concurrency in the per-dtype mode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("workers").setLevel(logging.WARNING)
    settings = QUICK if args.quick else FULL
    if args.quiet_budget is not None:
        settings = replace(settings, quiet_budget_s=args.quiet_budget)
    if args.dtypes:
        settings = replace(settings, concurrencies=tuple(args.concurrency))
        if args.repeats:
            settings = replace(settings, throughput_repeats=args.repeats)
        res = run_dtypes(settings, args.dtypes, args.threads)
        print_dtypes_report(res)
        out = args.out or REPO_ROOT / "benchmarks" / "results" / (
            f"engine_throughput_dtypes{'_quick' if args.quick else ''}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out}")
        return
    out = args.out or REPO_ROOT / "benchmarks" / "results" / (
        "engine_throughput_quick.json" if args.quick else "engine_throughput.json")

    res = run(settings)
    print_report(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
