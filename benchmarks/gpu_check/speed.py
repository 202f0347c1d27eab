"""Decode speed of the Qwen2.5-1.5B shape in bf16 (random weights): Duet (CUDA graphs on) vs HF
transformers ``generate`` in the same process, at batch 1 and 32, against the bandwidth roofline.

Roofline: a decode step reads every weight once (the tied embedding as the LM head; the lookup
reads one row per token), so at batch B it produces at most B * copy_bandwidth / weight_bytes
tokens per second, copy_bandwidth being a measured device-to-device copy (bytes read + written per
second). KV reads are ignored (short contexts), so the bound is optimistic.
HF: greedy ``generate`` of 128 new tokens minus a 1-token ``generate`` (its prefill), same prompts.
Targets: batch 1 >= 3x HF and >= 40% of the roofline; batch 32 >= 5x HF.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_check import common, models

CUDA_ONLY = True
BUDGET_S = 110.0
PROMPT, NEW = 32, 128


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes per second moved by a device-to-device copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def hf_tok_s(model, batch: int, vocab: int) -> float:
    prompts = torch.tensor(models.prompts(batch, vocab, PROMPT, PROMPT + 1, seed=batch), device="cuda")
    mask = torch.ones_like(prompts)

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompts, attention_mask=mask, max_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(4)  # warm-up
    return batch * (NEW - 1) / max(gen(NEW) - gen(1), 1e-9)


def run(ctx) -> dict:
    dtype = torch.bfloat16
    path = common.checkpoint(ctx, "qwen2.5-1.5b", dtype)
    bw = copy_bandwidth()
    eng = common.engine(path, ctx, dtype, max_num_seqs=32, cuda_graphs=True, graph_sizes=(1, 32))
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    duet = {}
    for b in (1, 32):
        common.decode_tok_s(eng, ctx, b, PROMPT, 8, seed=100 + b)  # warm-up
        duet[b] = common.decode_tok_s(eng, ctx, b, PROMPT, NEW, seed=b)
    del eng
    torch.cuda.empty_cache()
    hf = models.hf_model(path, dtype, "cuda")
    vocab = hf.config.vocab_size
    hf_rate = {b: hf_tok_s(hf, b, vocab) for b in (1, 32)}
    roof = {b: b * bw / weight_bytes for b in (1, 32)}
    out = {"copy_bandwidth_gb_s": round(bw / 1e9, 1), "weight_bytes": weight_bytes, "tok_s": {}}
    for b in (1, 32):
        out["tok_s"][f"batch{b}"] = {"duet": round(duet[b], 1), "hf_generate": round(hf_rate[b], 1),
                                     "vs_hf": round(duet[b] / hf_rate[b], 2), "roofline": round(roof[b], 1),
                                     "of_roofline": round(duet[b] / roof[b], 3)}
    t1, t32 = out["tok_s"]["batch1"], out["tok_s"]["batch32"]
    out["targets"] = {
        "batch1_ge_3x_hf": {"measured": t1["vs_hf"], "met": t1["vs_hf"] >= 3},
        "batch1_ge_40pct_roofline": {"measured": t1["of_roofline"], "met": t1["of_roofline"] >= 0.4},
        "batch32_ge_5x_hf": {"measured": t32["vs_hf"], "met": t32["vs_hf"] >= 5},
    }
    out["checks"] = {"measured": all(v["duet"] > 0 and v["hf_generate"] > 0 for v in out["tok_s"].values())}
    out["summary"] = (f"b1 {t1['duet']:.0f} tok/s ({t1['vs_hf']}x HF, {100 * t1['of_roofline']:.0f}% roofline); "
                      f"b32 {t32['duet']:.0f} tok/s ({t32['vs_hf']}x HF); copy {out['copy_bandwidth_gb_s']} GB/s")
    return out
