"""Engine greedy tokens vs HF transformers on the same device: equal in fp32; teacher-forced
next-token agreement in bf16 (GPU; fp32 on CPU).

fp32: each prompt's 32 greedy tokens from Duet (all prompts batched) must equal HF ``generate``'s
(one prompt at a time), for the SmolLM2-135M and Qwen2.5-0.5B shapes and a tiny Mixtral, random
weights. bf16: the fp32 continuation is fed to both in bf16 (prompt + continuation in one prefill)
and every position's argmax compared: Duet bf16 vs HF bf16 (target >= 99%), and each vs HF fp32.
"""

from __future__ import annotations

from typing import Any
import gc

import torch

from benchmarks.gpu_check import common, models

CUDA_ONLY = False
BUDGET_S = 100.0
SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "mixtral-tiny")
NEW_TOKENS = 32


@torch.inference_mode()
def duet_logits(eng, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of one fresh prefill of ``ids`` through the engine's runner."""
    from workers.engine.scheduler import ScheduledChunk

    bs = eng.runner.block_size
    chunk = ScheduledChunk("tf", list(ids), 0, list(range(-(-len(ids) // bs))), True)
    input_ids, positions, meta, _ = eng.runner._prepare([chunk], 0)
    hidden = eng.runner.model(input_ids, positions, eng.runner.kv_caches, meta)  # [T, E]
    return eng.runner.model.compute_logits(hidden).float()


@torch.inference_mode()
def hf_logits(model, ids: list[int], device: str) -> torch.Tensor:
    return model(torch.tensor([ids], device=device)).logits[0].float()


def _free(ctx) -> None:
    """Release the models just dropped before the next one is built: on CUDA their memory goes back
    to the device; a full-size shape on CPU may hold hundreds of MB in reference cycles. Tiny shapes
    on CPU skip the collection: a full pass over everything transformers loaded costs more than the
    few MB it would free."""
    if ctx.cuda or not ctx.tiny:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(ctx) -> dict:
    common.strict_fp32()
    dev = ctx.device
    out: dict = {"models": {}}
    checks = {}
    for shape in SHAPES:
        path = common.checkpoint(ctx, shape, torch.float32)
        # teacher-forced in bf16 (fp32 on CPU: bf16 has no CPU kernels, and the fp32 models built
        # for the greedy check are then the low-precision ones too: kept, not loaded again)
        low = common.dtype_for(ctx)
        eng = common.engine(path, ctx, torch.float32)
        prompts = models.prompts(4, eng.spec.vocab_size, seed=11)
        ours = common.greedy(eng, prompts, NEW_TOKENS)
        if low != torch.float32:
            del eng
            _free(ctx)
        hf = models.hf_model(path, torch.float32, dev)
        ref = common.hf_greedy(hf, prompts, NEW_TOKENS, dev)
        equal = sum(a == b for a, b in zip(ours, ref))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, ref)]
        r: dict[str, Any] = {"fp32_prompts_equal": f"{equal}/{len(prompts)}", "fp32_first_mismatch": first_diff}
        checks[f"{shape}/fp32_tokens_equal_hf"] = equal == len(prompts)
        seqs = [p + c for p, c in zip(prompts, ref)]
        hf32 = [hf_logits(hf, s, dev).argmax(-1) for s in seqs]
        del hf
        if low == torch.float32:
            hfl = hf32  # the same fp32 model on the same inputs
        else:
            _free(ctx)
            hf_low = models.hf_model(path, low, dev)
            hfl = [hf_logits(hf_low, s, dev).argmax(-1) for s in seqs]
            del hf_low
            _free(ctx)
            eng = common.engine(path, ctx, low)
        dl = [duet_logits(eng, s).argmax(-1) for s in seqs]  # a fresh prefill of each (no request is running)
        del eng
        _free(ctx)
        n = sum(len(s) for s in seqs)
        agree = sum(int((a == b).sum()) for a, b in zip(dl, hfl)) / n
        r.update({f"tf_{common.dname(low)}_duet_vs_hf": round(agree, 4),
                  f"tf_{common.dname(low)}_duet_vs_hf_fp32": round(sum(int((a == b).sum()) for a, b in zip(dl, hf32)) / n, 4),
                  f"tf_{common.dname(low)}_hf_vs_hf_fp32": round(sum(int((a == b).sum()) for a, b in zip(hfl, hf32)) / n, 4),
                  "tf_positions": n})
        checks[f"{shape}/tf_{common.dname(low)}_agree_ge_99pct"] = agree >= 0.99
        out["models"][shape] = r
    out["checks"] = checks
    out["summary"] = "; ".join(f"{s}: fp32 {r['fp32_prompts_equal']}, tf {next(v for k, v in r.items() if k.endswith('duet_vs_hf'))}"
                               for s, r in out["models"].items())
    return out
