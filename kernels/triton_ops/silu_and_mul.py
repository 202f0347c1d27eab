"""Triton SwiGLU gate on the fused [gate | up] projection (math: kernels/silu_and_mul.py):
out = silu(gate) * up, in fp32, stored in x's dtype. Grid: (rows, BLOCK-wide column tiles).

Axes: T rows (leading dims flattened), I intermediate size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_st, I, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < I
    g = tl.load(x_ptr + t * x_st + c, mask=cm, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * x_st + I + c, mask=cm, other=0.0).to(tl.float32)
    # silu(g) rounded to x's dtype, then the multiply in x's dtype: what F.silu(gate) * up does.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * I + c, (s * u).to(out_ptr.dtype.element_ty), mask=cm)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    check_device(x, "silu_and_mul")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x must be [..., 2I], got {tuple(x.shape)}")
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    if x2.shape[0] and I:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, BLOCK))](x2, out, x2.stride(0), I, BLOCK=BLOCK)
    return out
