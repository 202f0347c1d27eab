"""Triton weight-only int8 linear for CUDA (format: kernels/quant_formats.py).

y = scales * (x q^T) (+ b): each program computes a [BT tokens, BN rows] tile of y, walking K one
64-column chunk at a time; it loads the chunk's int8 codes, widens them to fp32 in registers and
feeds tl.dot, then scales each row once at the end. x is not quantized, so the reference is
``F.linear(x, dequantize_int8(q, scales))`` (kernels/int8_linear.py).

Axes: T tokens, N output rows, K input features, Kp padded K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device

BT, BN = 16, 32


@triton.jit
def _int8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, T, N, K, x_st, y_st, w_st,
                 HAS_BIAS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, 64)
    tm, nm = rt < T, rn < N
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for c in range(0, tl.cdiv(K, 64)):
        k = c * 64 + j
        x = tl.load(x_ptr + rt[:, None] * x_st + k[None, :], mask=tm[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * w_st + k[None, :], mask=nm[:, None], other=0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    acc *= tl.load(s_ptr + rn, mask=nm, other=0.0)[None, :]  # per-row scale
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rt[:, None] * y_st + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=tm[:, None] & nm[None, :])


def int8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
    check_device(x, "int8_linear")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    (T, K), N = x2.shape, qweight.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T and N:
        grid = (triton.cdiv(T, BT), triton.cdiv(N, BN))
        _int8_kernel[grid](x2, qweight, scales, bias if bias is not None else x2, y, T, N, K, x2.stride(0), N,
                           qweight.stride(0), HAS_BIAS=bias is not None, BT=BT, BN=BN)
    return y.view(*x.shape[:-1], N)
