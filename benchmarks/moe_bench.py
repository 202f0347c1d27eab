"""MoE benchmark on the upcycled SmolLM2 Mixtral (8 experts, top-2; workers/models/assets/upcycle.py):

  1. EP=1 vs EP=2 decode tokens/s at batch 1 and 16: EP=1 with 1 and with 2 torch threads, EP=2 as
     two ranks with 1 thread each (the same 2 cores as EP=1 x 2), gloo over loopback. On a machine
     shared with other jobs, 2 OpenMP threads per process can be 10-50x slower than 1 (spin-waiting
     threads descheduled), which is why EP=1 x 1 is measured too;
  2. all-to-all traffic per token: dispatch + combine rows that cross ranks, plus the all-gather of
     the replicated hidden states, in bytes (fp32);
  3. rebalancing on a skewed prompt set at EP=2: max/mean rank load (assignments computed per rank)
     and decode step time with the home placement, then again after the EPLB-style rebalancer
     replicated hot experts (target: max/mean <= 1.25), with the greedy tokens checked identical;
  4. the grouped expert GEMM kernel vs its torch reference at decode and prefill sizes.

    python -m benchmarks.moe_bench [--quick] [--out PATH]

Prints a table and writes JSON to benchmarks/results/moe_bench.json (moe_bench_quick.json with
--quick). Every gang run is timed inside rank 0 per engine step (decode steps only, median); the
contention column is the CPU share other processes took during the run (1.0 = both cores), from
/proc/stat minus this benchmark's own processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from workers.models.mixtral import MixtralForCausalLM
from benchmarks.engine_throughput import QuietGate, code_version, machine_info, quiet_median, record
from workers.parallel.groups import ParallelConfig, get_group
from workers.parallel.launch import spawn_gang

RESULTS = Path(__file__).resolve().parent / "results"
# (ep ranks, torch threads per rank): EP=1 on one core, EP=1 on both cores, EP=2 with a core per rank
CONFIGS = ((1, 1), (1, 2), (2, 1))
HIDDEN_BYTES = 576 * 4  # SmolLM2 hidden size, fp32
BALANCED = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
    "Explain quantum computing in simple terms.", "1, 2, 3, 4, 5,", "Translate to German: The weather is nice.",
    "Les fleurs du jardin sont", "What is 2+2?", "Write a haiku about autumn.", "import numpy as np\n",
    "The mitochondria is", "SELECT * FROM users WHERE", "In 1492, Columbus", "The quick brown fox",
    "My favourite recipe for bread:", "Dear hiring manager,",
]
SKEWED = [f"for i in range({n}):\n    total += i * {n}\nprint(total)\n" * 3 for n in range(16)]  # one domain


def _step_loop(engine, prompts: list[str], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Greedy-generate; returns decode step times (every chunk a single token) and tokens per prompt."""
    from workers.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    times: list[float] = []
    while engine.has_unfinished():
        decode = engine.scheduler.running and not engine.scheduler.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running)
        t0 = time.perf_counter()
        outs = engine.step()
        if decode:
            times.append(time.perf_counter() - t0)
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    return times, [tokens[i] for i in ids]


def _rank_rows(engine) -> torch.Tensor:
    return torch.stack([layer.rank_rows for layer in engine.runner.model.moe_layers()]).sum(0)  # [W]


def throughput_rank(rank: int, path: str, batches: list[int], max_tokens: int, repeats: int) -> dict | None:
    """Decode step times at each batch size; traffic counters (every rank returns its own)."""
    from workers.llm import LLM, engine_config
    from workers.engine.model_runner import ModelRunner
    from workers.engine.gang_runner import GangRunner, follow

    kw = dict(kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    runner = ModelRunner.from_config(engine_config(path, **kw))
    assert isinstance(runner.model, MixtralForCausalLM)  # the upcycled MoE checkpoint
    moe = runner.model.moe_layers()
    if rank != 0:
        follow(runner, get_group("gang"))
        return {"comm_rows": torch.stack([m.comm_rows for m in moe]).sum(0).tolist()}
    leader = GangRunner(runner, get_group("gang"))
    llm = LLM(path, runner=leader, **kw)
    _step_loop(llm.engine, BALANCED[:2], 4)  # warm-up
    for m in moe:
        m.comm_rows.zero_()
    out: dict[str, Any] = {"tokens_computed": 0}
    for b in batches:
        steps: list[float] = []
        for _ in range(repeats):
            times, toks = _step_loop(llm.engine, BALANCED[:b], max_tokens)
            steps += times
            prompt_tokens = sum(len(llm.engine.tokenizer.encode(p)) for p in BALANCED[:b])
            out["tokens_computed"] += prompt_tokens + b * (max_tokens - 1)
        out[f"b{b}_step_s"] = statistics.median(steps)
        out[f"b{b}_tok_s"] = b / statistics.median(steps)
    leader.stop()
    out["comm_rows"] = torch.stack([m.comm_rows for m in moe]).sum(0).tolist()
    return out


def rebalance_rank(rank: int, path: str, max_tokens: int) -> dict | None:
    """Skewed set with the home placement, then with the rebalancer's placement; loads, step times, tokens."""
    from workers.llm import LLM, engine_config
    from workers.engine.model_runner import ModelRunner
    from workers.parallel.eplb import RebalanceConfig, Rebalancer, imbalance
    from workers.engine.gang_runner import GangRunner, follow

    kw = dict(kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    runner = ModelRunner.from_config(engine_config(path, **kw))
    if rank != 0:
        follow(runner, get_group("gang"))
        return None
    assert isinstance(runner.model, MixtralForCausalLM)  # the upcycled MoE checkpoint
    moe = runner.model.moe_layers()
    leader = GangRunner(runner, get_group("gang"))
    llm = LLM(path, runner=leader, **kw)
    reb = Rebalancer(moe, RebalanceConfig(interval_steps=1, max_extra_per_rank=2, threshold=1.0))
    _step_loop(llm.engine, BALANCED[:2], 4)
    reb.maybe_plan()  # start the window here
    rows0 = _rank_rows(llm.engine)
    before_t, before_tok = _step_loop(llm.engine, SKEWED, max_tokens)
    rows1 = _rank_rows(llm.engine)
    loads = reb.window_loads()
    predicted = [imbalance(ld, m.home) for ld, m in zip(loads, moe)]
    plans = reb.maybe_plan()
    assert plans is not None, "the skewed set was balanced already"
    leader.rebalance(plans)
    after_t, after_tok = _step_loop(llm.engine, SKEWED, max_tokens)
    rows2 = _rank_rows(llm.engine)
    leader.stop()

    def ratio(rows: torch.Tensor) -> float:
        return (rows.max() / rows.float().mean()).item()

    per_layer_after = [imbalance(ld, p) for ld, p in zip(loads, plans)]
    return {
        "rank_rows_before": (rows1 - rows0).tolist(), "rank_rows_after": (rows2 - rows1).tolist(),
        "max_mean_before": ratio(rows1 - rows0), "max_mean_after": ratio(rows2 - rows1),
        "layer_max_mean_before_median": statistics.median(predicted),
        "layer_max_mean_after_median": statistics.median(per_layer_after),
        "layer_max_mean_after_max": max(per_layer_after),
        "replicas_added": sum(len(r) - 1 for p in plans for r in p.replicas),
        "step_s_before": statistics.median(before_t), "step_s_after": statistics.median(after_t),
        "tokens_identical": before_tok == after_tok,
    }


def _others_share(fn) -> tuple[Any, float]:
    """Run fn (which spawns processes and joins them); CPU share others took meanwhile (0..1)."""
    def sample():
        with open("/proc/stat") as f:
            v = list(map(int, f.readline().split()[1:9]))
        t = os.times()
        busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()

    (b0, o0, w0) = sample()
    value = fn()
    (b1, o1, w1) = sample()
    return value, max(0.0, (b1 - b0) - (o1 - o0)) / ((w1 - w0) * (os.cpu_count() or 1))


def grouped_gemm_bench(repeats: int, gate: QuietGate) -> dict[str, Any]:
    import kernels
    from kernels.grouped_gemm import grouped_gemm_ref

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3072, 576, generator=g) / 24  # the upcycled model's gate_up [E, 2I, H]
    res: dict[str, Any] = {}
    for name, rows in (("decode_b16", 32), ("prefill_512", 1024)):
        popularity = torch.tensor([8.0, 6, 5, 4, 3, 2, 1, 1])  # skewed, like the upcycled router
        counts = torch.multinomial(popularity, rows, replacement=True, generator=g).bincount(minlength=8)
        off = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        x = torch.randn(rows, 576, generator=g)
        torch.testing.assert_close(kernels.grouped_gemm(x, w, off), grouped_gemm_ref(x, w, off), rtol=1e-4, atol=1e-4)
        d: dict[str, Any] = {}
        for label, fn in (("kernel", kernels.grouped_gemm), ("ref", grouped_gemm_ref)):
            n = 20 if rows < 100 else 3
            for _ in range(repeats):
                record(d, label, gate.time(lambda: [fn(x, w, off) for _ in range(n)]), 1e3 / n)  # noqa: B023 - called in this iteration
        d["kernel_ms"] = quiet_median(d["kernel"], d["kernel_load"])
        d["ref_ms"] = quiet_median(d["ref"], d["ref_load"])
        d["speedup"] = d["ref_ms"] / d["kernel_ms"]
        res[name] = d
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (a smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    from workers.models.assets.upcycle import upcycle

    torch.set_num_threads(2)
    path = str(upcycle())
    max_tokens, repeats = (8, 1) if a.quick else (24, 3)
    result: dict[str, Any] = {"model": path, "machine": machine_info(), "code": code_version(),
                              "max_tokens": max_tokens, "repeats": repeats, "timestamp": time.time()}
    for ep, threads in CONFIGS:
        runs, share = _others_share(lambda: spawn_gang(throughput_rank, ParallelConfig(ep_size=ep),  # noqa: B023 - called in this iteration
                                                       args=(path, [1, 16], max_tokens, repeats), num_threads=threads,  # noqa: B023 - called in this iteration
                                                       timeout=1800))
        r = runs[0]
        rows = [sum(x["comm_rows"][0] for x in runs), sum(x["comm_rows"][1] for x in runs)]
        r["a2a_bytes_per_token"] = 2 * rows[0] * HIDDEN_BYTES / r["tokens_computed"]
        r["allgather_bytes_per_token"] = rows[1] * HIDDEN_BYTES / r["tokens_computed"]
        r["others_cpu_share"] = share
        result[f"ep{ep}x{threads}"] = r
    for b in (1, 16):
        for base in ("ep1x1", "ep1x2"):
            result[f"ep2x1_over_{base}_b{b}"] = result["ep2x1"][f"b{b}_tok_s"] / result[base][f"b{b}_tok_s"]
    reb, share = _others_share(lambda: spawn_gang(rebalance_rank, ParallelConfig(ep_size=2), args=(path, max_tokens),
                                                  timeout=1800))
    result["rebalance"] = {**reb[0], "others_cpu_share": share}
    result["rebalance"]["target_met"] = reb[0]["max_mean_after"] <= 1.25
    result["grouped_gemm"] = grouped_gemm_bench(3 if a.quick else 7, QuietGate(60.0 if a.quick else 180.0))
    _print(result)
    out = a.out or RESULTS / ("moe_bench_quick.json" if a.quick else "moe_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def _print(r: dict[str, Any]) -> None:
    keys = [f"ep{ep}x{t}" for ep, t in CONFIGS]
    print(f"{'':24}" + "".join(f"{f'EP={k[2]} ({k[2]}x{k[4]} thr)':>16}" for k in keys)
          + f"{'EP2/EP1x1':>11}{'EP2/EP1x2':>11}")
    for b in (1, 16):
        print(f"{'decode tok/s, batch ' + str(b):24}" + "".join(f"{r[k][f'b{b}_tok_s']:16.1f}" for k in keys)
              + f"{r[f'ep2x1_over_ep1x1_b{b}']:11.2f}{r[f'ep2x1_over_ep1x2_b{b}']:11.2f}")
    rows = (("all-to-all B/token", "a2a_bytes_per_token"), ("all-gather B/token", "allgather_bytes_per_token"),
            ("others CPU share", "others_cpu_share"))
    for label, field in rows:
        print(f"{label:24}" + "".join(f"{r[k][field]:16.2f}" for k in keys))
    rb = r["rebalance"]
    print(f"rebalance (EP=2, skewed set): rank rows {rb['rank_rows_before']} -> {rb['rank_rows_after']}, max/mean "
          f"{rb['max_mean_before']:.2f} -> {rb['max_mean_after']:.2f} (target <= 1.25: "
          f"{'yes' if rb['target_met'] else 'NO'}), "
          f"step {rb['step_s_before'] * 1e3:.1f} -> {rb['step_s_after'] * 1e3:.1f} ms, "
          f"{rb['replicas_added']} replicas, tokens identical: {rb['tokens_identical']}")
    for name, d in r["grouped_gemm"].items():
        print(f"grouped_gemm {name}: kernel {d['kernel_ms']:.3f} ms, ref {d['ref_ms']:.3f} ms, {d['speedup']:.2f}x")


if __name__ == "__main__":
    main()
