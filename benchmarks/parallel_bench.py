"""Tensor- and sequence-parallel speedups on CPU, side by side in one run, as JSON.

    python benchmarks/parallel_bench.py [--quick] [--model SmolLM2-135M-Instruct | PATH] [--out FILE]

What is measured (every configuration uses the same 2 cores: 1 rank x 2 torch threads against
2 ranks x 1 thread, local processes joined over gloo by workers/parallel/launch.py):
    TP decode     batch-1 and batch-8 greedy decode tokens/s of a gang of tp_size ranks (rank 0
                  schedules and broadcasts each step), TP=2 vs TP=1; the prompt is prefilled
                  before the clock starts.
    SP prefill    time of a 4k- and an 8k-token prefill (one chunk, the first token sampled) with
                  the prompt split over sp_size ranks by ring attention, SP=2 vs SP=1. ("8k" is
                  8000 tokens: SmolLM2's context is 8192.)
Targets (issue [parallel]): TP=2 >= 1.4x TP=1 decode for a 1.5B model; SP=2 >= 1.5x at 8k.

Noise: the machine is shared. Before each timed repeat rank 0 waits (within a budget) until
processes outside the gang use < 5% of the CPU, and records the share they took during the run:
system CPU time minus the gang's own processes (read from /proc), the gang-aware version of
engine_throughput.py's QuietGate. Medians are over the uncontended repeats (all, if none was).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # runnable as a plain script from anywhere

from benchmarks.engine_throughput import CONTENDED, code_version, machine_info  # noqa: E402
from workers.parallel.groups import ParallelConfig, get_group  # noqa: E402
from workers.parallel.launch import spawn_gang  # noqa: E402

logger = logging.getLogger("benchmarks.parallel_bench")
CORES = 2
TARGETS = {"tp2_decode_vs_tp1": 1.4, "sp2_prefill_8k_vs_sp1": 1.5}


class GangLoadMeter:
    """Share of the machine's CPU used by processes outside ``pids`` since start (0.5 = one of two cores)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        own = 0
        for pid in self.pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            own += int(fields[11]) + int(fields[12])  # utime + stime
        return (user + nice + system + irq + softirq + steal) / tick, own / tick, time.monotonic()

    def read(self) -> float:
        (b0, o0, w0), (b1, o1, w1) = self._start, self._sample()
        cpus = os.cpu_count() or 1
        others = (b1 - b0) - (o1 - o0) - cpus / os.sysconf("SC_CLK_TCK")
        return max(0.0, others) / (max(w1 - w0, 1e-9) * cpus)


def wait_quiet(pids: list[int], max_wait_s: float) -> float:
    """Wait until others use < 5% of the CPU over 0.25 s (at most max_wait_s); returns seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        meter = GangLoadMeter(pids)
        time.sleep(0.25)
        if meter.read() < 0.05:
            break
    return time.monotonic() - t0


def _timed(fn, pids: list[int], budget: dict[str, float]) -> dict[str, float]:
    budget["left"] -= wait_quiet(pids, min(20.0, max(0.0, budget["left"])))
    meter = GangLoadMeter(pids)
    t0 = time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - t0, "load": meter.read()}


def _run_to_end(engine, prompts: list[list[int]], max_tokens: int) -> None:
    from workers.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(None, p, params)
    while engine.has_unfinished():
        engine.step()


def bench_rank(rank: int, model: str, mode: str, settings: dict[str, Any]) -> dict | None:
    """One gang's measurements (rank 0 drives, the others follow)."""
    import torch

    from workers.llm import LLM
    from workers.parallel.gang import GangLeader, follow

    gang = get_group("gang")
    pids: list[Any] = [os.getpid()]
    if gang.world_size > 1:  # every rank's pid, so rank 0 can tell the gang's CPU time from others'
        pids = [None] * gang.world_size
        torch.distributed.all_gather_object(pids, os.getpid(), group=gang.group)
    llm = LLM(model, kv_cache_memory_bytes=settings["kv_bytes"], enable_prefix_caching=False,
              max_num_batched_tokens=settings["max_batched"], max_model_len=settings["max_model_len"])
    engine = llm.engine
    if rank != 0:
        follow(engine.runner, gang)
        return None
    leader = GangLeader(engine, gang)
    budget = {"left": settings["quiet_budget_s"]}
    out: dict[str, Any] = {}
    try:
        _run_to_end(engine, [[1, 2, 3, 4]], 4)  # warm-up
        if mode == "tp":
            for batch in settings["batches"]:
                prompts = [[(7 * i + j) % 5000 + 10 for j in range(32)] for i in range(batch)]
                n = settings["decode_tokens"]
                runs = []
                for _ in range(settings["repeats"]):
                    prefill = _timed(lambda: _run_to_end(engine, prompts, 1), pids, budget)
                    full = _timed(lambda: _run_to_end(engine, prompts, n + 1), pids, budget)
                    decode_s = max(1e-9, full["seconds"] - prefill["seconds"])
                    runs.append({"tokens_per_s": batch * n / decode_s, "load": max(prefill["load"], full["load"]),
                                 "prefill_s": prefill["seconds"], "total_s": full["seconds"]})
                out[f"decode_b{batch}"] = runs
        else:
            for length in settings["prefill_lengths"]:
                prompt = [(13 * j) % 5000 + 10 for j in range(length)]
                out[f"prefill_{length}"] = [_timed(lambda: _run_to_end(engine, [prompt], 1), pids, budget)
                                            for _ in range(settings["repeats"])]
    finally:
        leader.stop()
    out["quiet_budget_left_s"] = budget["left"]
    return out


def quiet_median(runs: list[dict[str, float]], key: str) -> float:
    quiet = [r[key] for r in runs if r["load"] <= CONTENDED]
    return statistics.median(quiet or [r[key] for r in runs])


def run_config(model: str, mode: str, size: int, settings: dict[str, Any]) -> dict:
    config = ParallelConfig(tp_size=size) if mode == "tp" else ParallelConfig(sp_size=size)
    t0 = time.monotonic()
    res = spawn_gang(bench_rank, config, args=(model, mode, settings), num_threads=CORES // size, timeout=3600)[0]
    logger.info("%s=%d done in %.0f s", mode, size, time.monotonic() - t0)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model alias or local HF checkpoint")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and tokens, 2k/4k prefills (a smoke run)")
    ap.add_argument("--skip", choices=["tp", "sp"], help="skip one part")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "parallel_bench.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    quick = args.quick
    base = {"repeats": 2 if quick else 3, "quiet_budget_s": 60.0 if quick else 180.0}
    tp_settings = {**base, "batches": [1, 8], "decode_tokens": 16 if quick else 64, "kv_bytes": 64 << 20,
                   "max_batched": 512, "max_model_len": 2048}
    lengths = [2048, 4096] if quick else [4096, 8000]
    sp_settings = {**base, "prefill_lengths": lengths, "kv_bytes": 512 << 20, "max_batched": 8192,
                   "max_model_len": 8192}
    res: dict[str, Any] = {"model": args.model, "machine": machine_info(), "code": code_version(),
                           "date": datetime.now(timezone.utc).isoformat(), "quick": quick, "targets": TARGETS}
    summary: dict[str, Any] = {}
    if args.skip != "tp":
        tp = {size: run_config(args.model, "tp", size, tp_settings) for size in (1, 2)}
        res["tp"] = {f"tp{k}": v for k, v in tp.items()}
        for b in tp_settings["batches"]:
            t1, t2 = (quiet_median(tp[s][f"decode_b{b}"], "tokens_per_s") for s in (1, 2))
            summary[f"decode_b{b}"] = {"tp1_tokens_per_s": t1, "tp2_tokens_per_s": t2, "speedup": t2 / t1}
    if args.skip != "sp":
        sp = {size: run_config(args.model, "sp", size, sp_settings) for size in (1, 2)}
        res["sp"] = {f"sp{k}": v for k, v in sp.items()}
        for n in lengths:
            s1, s2 = (quiet_median(sp[s][f"prefill_{n}"], "seconds") for s in (1, 2))
            summary[f"prefill_{n}"] = {"sp1_s": s1, "sp2_s": s2, "speedup": s1 / s2}
    res["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    for k, v in summary.items():
        logger.info("%s: %s", k, {a: round(b, 3) for a, b in v.items()})
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
