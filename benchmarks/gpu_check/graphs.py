"""CUDA graphs on vs off (workers/engine/cuda_graphs.py): identical greedy tokens, and decode tok/s at
batch 1, 8 and 64 (Qwen2.5-0.5B shape, bf16, random weights; target: graphs >= 1.5x eager at batch 1)."""

from __future__ import annotations

from typing import Any
import torch

from benchmarks.gpu_check import common, models

CUDA_ONLY = True
BUDGET_S = 70.0
BATCHES = (1, 8, 64)


def run(ctx) -> dict:
    dtype = torch.bfloat16
    path = common.checkpoint(ctx, "qwen2.5-0.5b", dtype)
    eager = common.engine(path, ctx, dtype, max_num_seqs=64)
    graphs = common.engine(path, ctx, dtype, max_num_seqs=64, cuda_graphs=True)
    prompts = models.prompts(8, eager.spec.vocab_size, 5, 60, seed=21)
    a = common.greedy(eager, prompts, 48)
    b = common.greedy(graphs, prompts, 48)
    solo_a = common.greedy(eager, prompts[:1], 48, prefix="s")
    solo_b = common.greedy(graphs, prompts[:1], 48, prefix="s")
    equal = sum(x == y for x, y in zip(a, b))
    out: dict[str, Any] = {"capture_sizes": list(graphs.runner.graphs.sizes), "prompts_equal": f"{equal}/{len(prompts)}",
           "batch1_equal": solo_a == solo_b, "tok_s": {}}
    for batch in BATCHES:
        n = 128 if batch == 1 else 64
        common.decode_tok_s(eager, ctx, batch, 16, 8, seed=batch)  # warm-up at this batch size
        e = common.decode_tok_s(eager, ctx, batch, 16, n, seed=batch)
        g = common.decode_tok_s(graphs, ctx, batch, 16, n, seed=batch)
        out["tok_s"][f"batch{batch}"] = {"eager": round(e, 1), "graphs": round(g, 1), "speedup": round(g / e, 2)}
    sp1 = out["tok_s"]["batch1"]["speedup"]
    out["targets"] = {"graphs_ge_1.5x_eager_at_batch1": {"measured": sp1, "met": sp1 >= 1.5}}
    out["checks"] = {"tokens_identical": equal == len(prompts) and solo_a == solo_b}
    out["summary"] = (f"tokens {out['prompts_equal']}; graphs/eager tok/s " +
                      ", ".join(f"b{k[5:]} {v['graphs']:.0f}/{v['eager']:.0f} ({v['speedup']}x)" for k, v in out["tok_s"].items()))
    return out
