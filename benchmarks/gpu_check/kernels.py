"""Every Triton kernel (kernels/triton_ops/) against its torch reference on CUDA, fp32 and bf16.

The wrappers in kernels/ dispatch CUDA tensors to Triton; ``kernels.fallback_counts()`` must stay
empty (a fallback would mean the reference ran, not the kernel). Cases cover partial blocks, GQA
ratios (Qwen2.5: 7 query heads per kv head), split-KV decode at long context, a slot of -1 (no
write) and empty experts. Tolerances: fp32 1e-4 (relative and absolute); bf16 outputs 3e-2 (a couple
of bf16 ulps: the kernels compute in fp32 and round once, the references round intermediates).
The quantized kernels take fp32 activations only (weight-only int8 / q4), so they run fp32.
"""

from __future__ import annotations

from typing import Any
import time

import torch

CUDA_ONLY = True
BUDGET_S = 75.0

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = TOL[dtype]
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _paged_case(H, G, D, bs, ctxs, dtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(ctxs)
    width = max(1, max(-(-c // bs) for c in ctxs)) + 1
    nblocks = B * width + 3
    kc = torch.randn(nblocks * bs, G, D, generator=g).to(dev, dtype)
    vc = torch.randn(nblocks * bs, G, D, generator=g).to(dev, dtype)
    bt = torch.randperm(nblocks, generator=g)[: B * width].view(B, width).to(dev, torch.int32)
    return kc, vc, bt, torch.tensor(ctxs, dtype=torch.int32, device=dev)


def case_rms_norm(dtype, dev):
    import kernels

    x = torch.randn(37, 1536, device=dev, dtype=dtype)
    r = torch.randn(37, 1536, device=dev, dtype=dtype)
    w = torch.randn(1536, device=dev, dtype=dtype)
    out, res = kernels.rms_norm(x, w, 1e-6, r.clone())
    ref, ref_res = kernels.rms_norm_ref(x, w, 1e-6, r.clone())
    out2, _ = kernels.rms_norm(x, w, 1e-6)
    ref2, _ = kernels.rms_norm_ref(x, w, 1e-6)
    return [(out, ref), (res, ref_res), (out2, ref2)]


def case_silu_and_mul(dtype, dev):
    import kernels

    x = torch.randn(19, 2 * 8960, device=dev, dtype=dtype)
    return [(kernels.silu_and_mul(x), kernels.silu_and_mul_ref(x))]


def case_rotary_and_cache_write(dtype, dev):
    import kernels

    T, H, G, D, S = 11, 14, 2, 64, 64
    q, k, v = (torch.randn(T, n, D, device=dev, dtype=dtype) for n in (H, G, G))
    ang = torch.rand(T, D // 2, device=dev) * 6.28
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = torch.randperm(S, device=dev)[:T]
    slots[3] = -1  # not written
    outs = []
    for fn in (kernels.rotary_and_cache_write, kernels.rotary_and_cache_write_ref):
        qq, kk = q.clone(), k.clone()
        kc = torch.zeros(S, G, D, device=dev, dtype=dtype)
        vc = torch.zeros(S, G, D, device=dev, dtype=dtype)
        fn(qq, kk, v, cos, sin, kc, vc, slots)
        outs.append((qq, kk, kc, vc))
    return list(zip(outs[0], outs[1]))


def case_paged_decode_attention(dtype, dev):
    import kernels

    pairs = []
    for H, G, D, bs, ctxs in ((14, 2, 64, 16, [1, 17, 300, 0]), (9, 3, 64, 16, [2000]), (12, 2, 128, 16, [5, 900])):
        kc, vc, bt, cl = _paged_case(H, G, D, bs, ctxs, dtype, dev)
        q = torch.randn(len(ctxs), H, D, device=dev, dtype=dtype)
        out, lse = kernels.paged_decode_attention(q, kc, vc, bt, cl, bs, D**-0.5, return_lse=True)
        ref, ref_lse = kernels.paged_decode_attention_ref(q, kc, vc, bt, cl, bs, D**-0.5, return_lse=True)
        live = cl > 0
        pairs += [(out, ref), (lse[live], ref_lse[live])]
    return pairs


def case_varlen_paged_attention(dtype, dev):
    import kernels

    pairs = []
    H, G, D, bs = 14, 2, 64, 16
    ns, ctxs = [40, 17, 5], [40, 300, 2000]
    kc, vc, bt, cl = _paged_case(H, G, D, bs, ctxs, dtype, dev, seed=3)
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(ns), H, D, device=dev, dtype=dtype)
    parents = torch.tensor([-1] * 40 + [-1] * 17 + [-1, 0, 0, 1, 2], dtype=torch.int32, device=dev)
    for tree in (None, parents):
        out = kernels.varlen_paged_attention(q, kc, vc, bt, cu, cl, bs, D**-0.5, tree_parents=tree)
        ref = kernels.varlen_paged_attention_ref(q, kc, vc, bt, cu, cl, bs, D**-0.5, tree_parents=tree)
        pairs.append((out, ref))
    return pairs


def case_merge_attn_states(dtype, dev):
    import kernels

    outs = [torch.randn(9, 14, 64, device=dev, dtype=dtype) for _ in range(3)]
    lses = [torch.randn(9, 14, device=dev) for _ in range(3)]
    lses[1][2] = float("-inf")
    out, lse = kernels.merge_attn_states(outs, lses)
    ref, ref_lse = kernels.merge_attn_states_ref(outs, lses)
    return [(out, ref), (lse, ref_lse)]


def case_grouped_gemm(dtype, dev):
    import kernels

    E, N, K = 8, 512, 256
    counts = torch.tensor([5, 0, 17, 1, 0, 33, 2, 9])  # empty experts included
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(dev)
    x = torch.randn(int(counts.sum()), K, device=dev, dtype=dtype)
    w = torch.randn(E, N, K, device=dev, dtype=dtype) / 16
    return [(kernels.grouped_gemm(x, w, offsets), kernels.grouped_gemm_ref(x, w, offsets))]


def case_lora(dtype, dev):
    """Batched LoRA (kernels/lora.py -> kernels/triton_ops/lora.py): 5 slots, base tokens (-1)
    interleaved, rank 16 zero-padded to 24 (a non-power-of-two R), y in the model's dtype, the
    slots' A/B and scales float32; y updated in place on a column slice (a fused projection's part)."""
    import kernels.lora as kl

    S, R, K, N, T = 5, 24, 576, 960, 37
    g = torch.Generator(device="cpu").manual_seed(3)
    a = torch.randn(S, R, K, generator=g) / K**0.5
    b = torch.randn(S, N, R, generator=g) / R**0.5
    a[:, 16:], b[:, :, 16:] = 0, 0
    scales = torch.rand(S, generator=g) + 0.5
    idx = torch.randint(-1, S, (T,), generator=g)
    x = torch.randn(T, K, generator=g).to(dtype)
    y = torch.randn(T, N + 64, generator=g).to(dtype)
    want = kl.lora_ref(y.float().clone()[:, 32:32 + N], x.float(), a, b, scales, idx)
    got = y.to(dev).clone()
    kl.lora(got[:, 32:32 + N], x.to(dev), a.to(dev), b.to(dev), scales.to(dev), idx.to(dev))
    return [(got[:, 32:32 + N], want), (got[:, :32], y[:, :32]), (got[:, 32 + N:], y[:, 32 + N:])]


def case_int8_linear(dtype, dev):
    import kernels
    from kernels.quant_formats import quantize_int8

    w = torch.randn(1536, 896)
    q, s = quantize_int8(w)
    x = torch.randn(7, 896)
    b = torch.randn(1536)
    return [(kernels.int8_linear(x.to(dev), q.to(dev), s.to(dev), b.to(dev)), kernels.int8_linear_ref(x, q, s, b))]


def case_q4_linear(dtype, dev):
    import torch.nn.functional as F

    import kernels
    from kernels.quant_formats import dequantize_q4, quantize_q4

    w = torch.randn(1024, 896)
    packed, d, m = quantize_q4(w)
    x = torch.randn(5, 896)
    ref = F.linear(x.double(), dequantize_q4(packed, d, m, 896).double()).float()  # weight-only: x unquantized
    return [(kernels.q4_linear(x.to(dev), packed.to(dev), d.to(dev), m.to(dev)), ref)]


CASES = {
    "rms_norm": (case_rms_norm, (torch.float32, torch.bfloat16)),
    "silu_and_mul": (case_silu_and_mul, (torch.float32, torch.bfloat16)),
    "rotary_and_cache_write": (case_rotary_and_cache_write, (torch.float32, torch.bfloat16)),
    "paged_decode_attention": (case_paged_decode_attention, (torch.float32, torch.bfloat16)),
    "varlen_paged_attention": (case_varlen_paged_attention, (torch.float32, torch.bfloat16)),
    "merge_attn_states": (case_merge_attn_states, (torch.float32, torch.bfloat16)),
    "grouped_gemm": (case_grouped_gemm, (torch.float32, torch.bfloat16)),
    "lora": (case_lora, (torch.float32, torch.bfloat16)),
    "int8_linear": (case_int8_linear, (torch.float32,)),
    "q4_linear": (case_q4_linear, (torch.float32,)),
}


def run(ctx) -> dict:
    import kernels

    torch.manual_seed(0)
    kernels.reset_fallback_counts()
    results: dict[str, dict[str, Any]] = {}
    checks: dict[str, Any] = {}
    for name, (case, dtypes) in CASES.items():
        for dtype in dtypes:
            key = f"{name}/{str(dtype).removeprefix('torch.')}"
            t0 = time.perf_counter()
            try:
                pairs = case(dtype, "cuda")
                torch.cuda.synchronize()
                ok = all(_close(a, b.to(a.device), dtype) for a, b in pairs)
                results[key] = {"max_abs_err": max(_err(a, b.to(a.device)) for a, b in pairs), "ok": ok,
                                "seconds": round(time.perf_counter() - t0, 2)}
            except Exception as e:  # noqa: BLE001 - one kernel's failure must not hide the others'
                ok = False
                results[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            checks[key] = ok
    fallbacks = kernels.fallback_counts()
    checks["no_reference_fallbacks"] = not fallbacks
    n_ok = sum(1 for k, v in checks.items() if v and "/" in k)
    return {"cases": results, "fallbacks": fallbacks, "checks": checks,
            "summary": f"{n_ok}/{len(checks) - 1} kernel x dtype cases match their _ref"}
