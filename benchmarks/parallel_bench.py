"""Tensor- and sequence-parallel speedups on CPU, side by side in one run, as JSON.

    python benchmarks/parallel_bench.py [--quick] [--model SmolLM2-135M-Instruct | PATH]
        [--quantization none | int8 | q4] [--out FILE]

What is measured (every configuration uses the same 2 cores: 1 rank x 2 torch threads against
2 ranks x 1 thread, local processes joined by workers/parallel/launch.py). Each 2-rank
configuration runs once per transport in ``--comm`` (default both): ``shm``, the same-host
shared-memory collectives (workers/parallel/shm_comm.py), and ``gloo``, loopback TCP:
    all-reduce    latency of one all-reduce of a [1, E] and [8, E] fp32 tensor (E = 576, SmolLM2's
                  hidden size, and 1536, Qwen2.5-1.5B's) between 2 ranks, shm vs gloo, median us.
    TP decode     batch-1 and batch-8 greedy decode tokens/s of a gang of tp_size ranks (rank 0
                  schedules and broadcasts each step), TP=2 vs TP=1; the prompt is prefilled
                  before the clock starts.
    SP prefill    time of a 4k- and an 8k-token prefill (one chunk, the first token sampled) with
                  the prompt split over sp_size ranks by ring attention, SP=2 vs SP=1. ("8k" is
                  8000 tokens: SmolLM2's context is 8192.)
Targets (the tensor/sequence-parallel work's goals): TP=2 >= 1.4x TP=1 decode for a 1.5B model; SP=2 >= 1.5x at 8k.
``--quantization`` loads every configuration's model with that weight format (int8 / q4 layers
sharded over the tp ranks, workers/layers/quant_parallel.py), so TP=2 vs TP=1 compares like
with like.

Noise: the machine is shared. Before each timed repeat rank 0 waits (within a budget) until
processes outside the gang use < 5% of the CPU, and records the share they took during the run:
system CPU time minus the gang's own processes (read from /proc), the gang-aware version of
engine_throughput.py's QuietGate. Medians are over the uncontended repeats (all, if none was).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from datetime import datetime, UTC
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

    from workers.llm import LLM, engine_config
    from workers.engine.model_runner import ModelRunner
    from workers.engine.gang_runner import GangRunner, follow

    gang = get_group("gang")
    pids: list[Any] = [os.getpid()]
    if gang.world_size > 1:  # every rank's pid, so rank 0 can tell the gang's CPU time from others'
        pids = [None] * gang.world_size
        torch.distributed.all_gather_object(pids, os.getpid(), group=gang.group)
    kw = dict(kv_cache_memory_bytes=settings["kv_bytes"], enable_prefix_caching=False,
              max_num_batched_tokens=settings["max_batched"], max_model_len=settings["max_model_len"],
              quantization=settings["quantization"])
    runner = ModelRunner.from_config(engine_config(model, **kw))
    if rank != 0:
        follow(runner, gang)
        return None
    leader = GangRunner(runner, gang)
    engine = LLM(model, runner=leader, **kw).engine
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
                    prefill = _timed(lambda: _run_to_end(engine, prompts, 1), pids, budget)  # noqa: B023 - called in this iteration
                    full = _timed(lambda: _run_to_end(engine, prompts, n + 1), pids, budget)  # noqa: B023 - called in this iteration
                    decode_s = full["seconds"] - prefill["seconds"]  # <= 0: noise exceeded the decode time
                    rate = batch * n / decode_s if decode_s > 0 else math.nan  # nan: no figure from this repeat
                    runs.append({"tokens_per_s": rate, "load": max(prefill["load"], full["load"]),
                                 "prefill_s": prefill["seconds"], "total_s": full["seconds"]})
                out[f"decode_b{batch}"] = runs
        else:
            for length in settings["prefill_lengths"]:
                prompt = [(13 * j) % 5000 + 10 for j in range(length)]
                out[f"prefill_{length}"] = [_timed(lambda: _run_to_end(engine, [prompt], 1), pids, budget)  # noqa: B023 - called in this iteration
                                            for _ in range(settings["repeats"])]
    finally:
        leader.stop()
    out["quiet_budget_left_s"] = budget["left"]
    return out


def allreduce_rank(rank: int, shapes: list[list[int]], iters: int) -> dict[str, dict[str, float]]:
    """Median latency (us) of one all-reduce per shape over shared memory and over the gloo group."""
    import torch
    import torch.distributed as dist

    g = get_group("tp")
    assert g.shm is not None, "the all-reduce micro-benchmark needs a same-host gang"
    ways = {"shm": g.shm.all_reduce, "gloo": lambda t: dist.all_reduce(t, group=g.group)}
    out: dict[str, dict[str, float]] = {}
    for shape in shapes:
        x0 = torch.randn(shape)
        x = x0.clone()
        row = {}
        for name, fn in ways.items():
            times = []
            for _ in range(iters):
                x.copy_(x0)  # fixed values: repeated sums would overflow
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            row[f"{name}_us"] = statistics.median(times) * 1e6
        row["speedup"] = row["gloo_us"] / row["shm_us"]
        out["x".join(map(str, shape))] = row
    return out


def quiet_median(runs: list[dict[str, float]], key: str) -> float:
    """Median over the uncontended repeats (all, if none was); repeats without a figure (nan) skipped."""
    valid = [r for r in runs if not math.isnan(r[key])]
    quiet = [r[key] for r in valid if r["load"] <= CONTENDED]
    return statistics.median(quiet or [r[key] for r in valid] or [math.nan])


def run_config(model: str, mode: str, size: int, settings: dict[str, Any], comm: str = "auto") -> dict:
    config = ParallelConfig(tp_size=size) if mode == "tp" else ParallelConfig(sp_size=size)
    t0 = time.monotonic()
    res = spawn_gang(bench_rank, config, args=(model, mode, settings), num_threads=CORES // size, timeout=3600,
                     comm=comm)[0]
    logger.info("%s=%d (%s) done in %.0f s", mode, size, comm, time.monotonic() - t0)
    return res


def run_configs(model: str, mode: str, settings: dict[str, Any], comms: list[str]) -> dict[str, dict]:
    """{"tp1": ..., "tp2_shm": ..., "tp2_gloo": ...} (likewise sp): one rank, then two per transport."""
    out = {f"{mode}1": run_config(model, mode, 1, settings)}
    for comm in comms:
        out[f"{mode}2_{comm}"] = run_config(model, mode, 2, settings, comm)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model alias or local HF checkpoint")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and tokens, 2k/4k prefills (a smoke run)")
    ap.add_argument("--skip", choices=["allreduce", "tp", "sp"], action="append", default=[],
                    help="skip a part (repeatable)")
    ap.add_argument("--repeats", type=int, help="timed repeats per measurement (default 3, 2 with --quick)")
    ap.add_argument("--comm", default="shm,gloo",
                    help="transports to run the 2-rank gangs on, comma-separated (shm, gloo); default both")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "q4"],
                    help="weights of the linear layers in every configuration (default none: float32)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "parallel_bench.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    quick = args.quick
    base = {"repeats": args.repeats or (2 if quick else 3), "quiet_budget_s": 60.0 if quick else 180.0,
            "quantization": args.quantization}
    tp_settings = {**base, "batches": [1, 8], "decode_tokens": 16 if quick else 64, "kv_bytes": 64 << 20,
                   "max_batched": 512, "max_model_len": 2048}
    lengths = [2048, 4096] if quick else [4096, 8000]
    sp_settings = {**base, "prefill_lengths": lengths, "kv_bytes": 512 << 20, "max_batched": 8192,
                   "max_model_len": 8192}
    res: dict[str, Any] = {"model": args.model, "quantization": args.quantization, "machine": machine_info(),
                           "code": code_version(), "date": datetime.now(UTC).isoformat(), "quick": quick,
                           "targets": TARGETS}
    comms = [c.strip() for c in args.comm.split(",") if c.strip()]
    if not comms or any(c not in ("shm", "gloo") for c in comms):
        ap.error(f"--comm {args.comm!r}: a comma-separated subset of shm, gloo")
    res["comm"] = comms
    summary: dict[str, Any] = {}
    if "allreduce" not in args.skip:
        shapes = [[1, 576], [8, 576], [1, 1536], [8, 1536]]
        res["allreduce"] = spawn_gang(allreduce_rank, ParallelConfig(tp_size=2), args=(shapes, 500 if quick else 3000),
                                      comm="shm")[0]
        summary["allreduce_us"] = res["allreduce"]
    if "tp" not in args.skip:
        res["tp"] = tp = run_configs(args.model, "tp", tp_settings, comms)
        for b in tp_settings["batches"]:
            rates = {k: quiet_median(v[f"decode_b{b}"], "tokens_per_s") for k, v in tp.items()}
            summary[f"decode_b{b}"] = {**{f"{k}_tokens_per_s": r for k, r in rates.items()},
                                       **{f"speedup_{k}": r / rates["tp1"] for k, r in rates.items() if k != "tp1"}}
    if "sp" not in args.skip:
        res["sp"] = sp = run_configs(args.model, "sp", sp_settings, comms)
        for n in lengths:
            secs = {k: quiet_median(v[f"prefill_{n}"], "seconds") for k, v in sp.items()}
            summary[f"prefill_{n}"] = {**{f"{k}_s": t for k, t in secs.items()},
                                       **{f"speedup_{k}": secs["sp1"] / t for k, t in secs.items() if k != "sp1"}}
    res["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    for k, v in summary.items():
        logger.info("%s: %s", k, json.dumps(v, default=lambda x: round(x, 3)))
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
