"""Triton fused (residual add +) RMSNorm (math: kernels/rms_norm.py). One program per row of E
features (padded to a power of two): r = x + residual rounded to x's dtype (as the reference
stores it), mean(r^2) and the scaling in fp32, the weight multiply in x's dtype.

Axes: T rows (leading dims flattened), E hidden size (padded to BE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_st, res_st, E, eps,
                     BE: tl.constexpr, HAS_RES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(x_ptr + t * x_st + e, mask=em, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + t * res_st + e, mask=em, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * E + e, x, mask=em)
    r = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / E + eps)
    y = (r * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds y to x's dtype first
    w = tl.load(w_ptr + e, mask=em, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * E + e, (w * y).to(out_ptr.dtype.element_ty), mask=em)


def rms_norm_triton(
    x: torch.Tensor,  # [..., E]
    weight: torch.Tensor,  # [E]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., E]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (out [..., E], new_residual [..., E] | None)
    check_device(x, "rms_norm")
    E = x.shape[-1]
    x2 = x.reshape(-1, E)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res2 = res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        res2 = residual.reshape(-1, E)
        res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
        res_out = torch.empty_like(out)
    T = x2.shape[0]
    if T:
        _rms_norm_kernel[(T,)](
            x2, res2 if res2 is not None else x2, weight.contiguous(), out, res_out if res_out is not None else out,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, E, float(eps),
            BE=next_pow2(E), HAS_RES=residual is not None,
        )
    return out, res_out
