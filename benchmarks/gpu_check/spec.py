"""A CPU drafter beside a GPU target (``speculative.drafter_device: cpu``): lossless, and its speed
against the target alone.

The drafter is a DraftEngine on CPU (float32) behind the Drafter gRPC service in this process (in a
deployment it is a Ray actor, possibly on a CPU-only node); the target decodes on CUDA in bf16. The
drafter has the target's weights (random-weight models of different sizes would agree on nothing),
so acceptance is near its ceiling; the speed ratio then shows what the CPU <-> GPU round trip and
the CPU drafter's own speed cost. Greedy speculative output must equal plain greedy output.
On a CPU-only machine both run on CPU (the same code path, drafter_device set explicitly).
"""

from __future__ import annotations

import dataclasses
import time


from benchmarks.gpu_check import common, models

CUDA_ONLY = False
BUDGET_S = 55.0
NEW = 48


def _timed(eng, ctx, prompts, prefix):
    common.sync(ctx)
    t0 = time.perf_counter()
    out = common.greedy(eng, prompts, NEW, prefix=prefix)
    common.sync(ctx)
    return out, sum(map(len, out)) / (time.perf_counter() - t0)


def run(ctx) -> dict:
    from workers.config import SpeculativeConfig
    from workers.spec_decode.draft_model import DraftModelProposer
    from workers.spec_decode.drafter import DraftEngine
    from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

    dtype = common.dtype_for(ctx)
    path = common.checkpoint(ctx, "smollm2-135m", dtype)
    spec_cfg = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=4,
                                 adaptive=False, overlap=False, drafter_device="cpu", draft_timeout_s=10.0)
    plain = common.engine(path, ctx, dtype)
    prompts = models.prompts(4, plain.spec.vocab_size, 10, 40, seed=41)
    want = common.greedy(plain, prompts, NEW)
    common.greedy(plain, prompts[:1], 8, prefix="w")  # warm-up
    _, plain_rate = _timed(plain, ctx, prompts[:1], "p")
    target_cfg = plain.config
    del plain
    spec_engine_cfg = dataclasses.replace(target_cfg, speculative=spec_cfg)
    drafter = DraftEngine.for_target(str(path), "none", spec_engine_cfg, None)
    server, endpoint = serve_drafter(drafter)
    try:
        proposer = DraftModelProposer(endpoint_connector(endpoint), spec_cfg.draft_timeout_s, spec_cfg.overlap)
        from workers.build import build_engine

        eng = build_engine(spec_engine_cfg, proposer=proposer)
        got = common.greedy(eng, prompts, NEW)
        _, spec_rate = _timed(eng, ctx, prompts[:1], "s")
        stats = eng.stats().spec
    finally:
        server.stop(grace=0)
    equal = sum(a == b for a, b in zip(got, want))
    drafter_device = str(drafter.runner.device)
    out = {"target_device": ctx.device, "drafter_device": drafter_device, "target_dtype": common.dname(dtype),
           "drafter_dtype": str(drafter.runner.kv_cache.dtype).removeprefix("torch."),
           "prompts_equal": f"{equal}/{len(prompts)}",
           "batch1_tok_s": {"target_alone": round(plain_rate, 1), "with_cpu_drafter": round(spec_rate, 1),
                            "ratio": round(spec_rate / plain_rate, 2)},
           "spec_stats": dataclasses.asdict(stats), "acceptance_rate": round(stats.acceptance_rate, 3)}
    out["checks"] = {"lossless": equal == len(prompts), "drafter_on_cpu": drafter_device == "cpu"}
    out["summary"] = (f"lossless {out['prompts_equal']}; batch-1 {spec_rate:.0f} tok/s with the CPU drafter vs "
                      f"{plain_rate:.0f} alone ({out['batch1_tok_s']['ratio']}x)")
    return out
