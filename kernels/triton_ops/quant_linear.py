"""Triton q4 linear for CUDA (format: kernels/quant_formats.py; int8: triton_ops/int8_linear.py).

y = x dequant(W)^T (+ b): each program computes a [BT tokens, BN rows] tile of y, walking K one
64-column chunk at a time; it unpacks the chunk's codes in registers (q4: the 32 packed bytes give
block 2c in the low nibbles and block 2c + 1 in the high ones), de-quantizes them
in fp32 and feeds tl.dot. Unlike the CPU kernel, x is NOT quantized (a GPU has the FLOPs; only
weight bytes matter), so the reference is ``F.linear(x, dequantize(W))``.

Axes: T tokens, N output rows, K input features, Kp padded K, B = Kp / 32 blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device

BT, BN = 16, 32


@triton.jit
def _x_tile(x_ptr, rt, tm, x_st, k, K):
    return tl.load(x_ptr + rt[:, None] * x_st + k[None, :], mask=tm[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)


@triton.jit
def _q4_kernel(x_ptr, w_ptr, d_ptr, m_ptr, b_ptr, y_ptr, T, N, K, x_st, y_st, w_st, NB,
               HAS_BIAS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, 32)
    tm, nm = rt < T, rn < N
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for c in range(0, tl.cdiv(K, 64)):
        packed = tl.load(w_ptr + rn[:, None].to(tl.int64) * w_st + c * 32 + j[None, :], mask=nm[:, None], other=0)
        blk = rn.to(tl.int64) * NB + 2 * c
        d0 = tl.load(d_ptr + blk, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        d1 = tl.load(d_ptr + blk + 1, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        m0 = tl.load(m_ptr + blk, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        m1 = tl.load(m_ptr + blk + 1, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        w0 = (packed & 15).to(tl.float32) * d0[:, None] + m0[:, None]  # [BN, 32] block 2c
        w1 = (packed >> 4).to(tl.float32) * d1[:, None] + m1[:, None]  # [BN, 32] block 2c + 1
        x0 = _x_tile(x_ptr, rt, tm, x_st, c * 64 + j, K)  # [BT, 32]
        x1 = _x_tile(x_ptr, rt, tm, x_st, c * 64 + 32 + j, K)
        acc += tl.dot(x0, tl.trans(w0), input_precision="ieee")
        acc += tl.dot(x1, tl.trans(w1), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rt[:, None] * y_st + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=tm[:, None] & nm[None, :])


def _prep(x: torch.Tensor, op: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    check_device(x, op)
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), tuple(x.shape[:-1])


def q4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
    x2, lead = _prep(x, "q4_linear")
    (T, K), N = x2.shape, qweight.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T and N:
        grid = (triton.cdiv(T, BT), triton.cdiv(N, BN))
        _q4_kernel[grid](x2, qweight, d, m, bias if bias is not None else x2, y, T, N, K, x2.stride(0), N,
                         qweight.stride(0), d.shape[1], HAS_BIAS=bias is not None, BT=BT, BN=BN)
    return y.view(*lead, N)

