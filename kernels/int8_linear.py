"""int8 linear: y = x W^T (+ b), W int8 with one fp32 scale per output row, x quantized to int8 on the fly.

Terms: ``qweight`` int8 [N, Kp] and ``scales`` fp32 [N] are kernels/quant_formats.py's int8 format
(w[n, k] ~= scales[n] * qweight[n, k], K zero-padded to Kp, a multiple of 64). The activations are
quantized per token and block of 32 exactly as for q4 (``quantize_activations_ref``: sx = max|x| /
127, xq = round(x / sx)), so each block's dot product with a weight row is an exact integer sum:

    y[t, n] = scales[n] * sum_b sx[t, b] * (xq[t, b] . q[n, b])  (+ b[n])

Why blocks of 32 and not one scale per token: an outlier feature (LLM activations have a few,
tens of times the rest) then coarsens only the 32 values of its block, not the whole row; and a
row-parallel shard (whole blocks) quantizes its slice of x exactly as one rank does. What int8
activations cost against fp32 (perplexity, teacher-forced agreement): benchmarks/README.md,
"quality_vs_fp32.py".

Kernel (kernels/csrc/quant_linear.cpp, shared with q4): AVX-512 VNNI repacks 16-row tiles so one
vpdpbusd does 64 multiply-adds into 16 rows' accumulators, and the per-block float step runs on 16
rows at once; that keeps batched steps (8-64 sequences, prefill) fast, where the former
weight-only kernel (int8 widened to fp32, one FMA per weight and token) was compute bound. AVX2
and scalar paths compute the same integer dots. Batch invariant: a token's row of y is
bit-identical whatever other rows share the call (tests/kernels/test_int8_linear_kernel.py).

Reference: ``int8_linear_ref`` computes the same activation quantization and integer dots, then
the scaling in float64; the kernel matches it up to fp32 rounding of the per-block sums.

Dispatch: fp32 CPU x -> C++ kernel; CPU with the kernels disabled -> the reference; CUDA -> the
Triton kernel (kernels/triton_ops/int8_linear.py: weight-only, x stays in its dtype; its
reference is dequantize + F.linear) when triton is installed, else dequantize + F.linear, counted
as a fallback.

Worked example: x = [[1, 2]], W = [[1, 0], [0, 1], [1, 1]] -> scales = [1/127] * 3, q = 127 * W;
x's block scale is 2/127 and xq = [64, 127] (1 became 63.5, rounded to even) -> y = (2/127) *
(1/127) * [64 * 127, 127 * 127, 191 * 127] = [1.0079, 2, 3.0079].

Axes: T tokens, K input features, Kp padded K, N output features, B = Kp / 32 blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _build, _triton
from kernels.quant_formats import BLOCK, dequantize_int8
from kernels.quant_linear import quantize_activations_ref

_F32 = torch.float32


def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, K], qweight int8 [N, Kp], scales [N], bias [N] -> [T, N]
    T, (N, Kp) = x.shape[0], qweight.shape
    xq, sx = quantize_activations_ref(x, Kp)  # [T, Kp], [T, B]
    dots = torch.einsum("tbk,nbk->tnb", xq.double().view(T, -1, BLOCK), qweight.double().view(N, -1, BLOCK))
    y = (dots * sx.double()[:, None, :]).sum(-1) * scales.double()  # [T, N]
    return (y if bias is None else y + bias.double()).float()


def int8_tiles(qweight: torch.Tensor) -> torch.Tensor | None:
    """The weights in the AVX-512 VNNI path's tile order (uint8 [ceil(N / 16), 16 Kp]: the codes of
    16 rows interleaved 4 at a time, biased by 128; kernels/csrc/kernels.h ``make_int8_tiles``), for
    ``int8_linear(..., tiles=)``; None without the C++ kernels or for a weight off the CPU. Worth
    making where ``quant_tiles_used()`` (kernels/quant_linear.py: the same path serves both formats);
    it costs the codes' memory again (8 bits per weight)."""
    ext = _build.ext()
    if ext is None or not qweight.is_cpu:
        return None
    return ext.int8_tiles(qweight.contiguous())


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                tiles: torch.Tensor | None = None) -> torch.Tensor:
    # x [..., K], qweight int8 [N, Kp], scales [N], bias [N] -> [..., N]
    # tiles: int8_tiles(qweight) or None; the same result either way (bit for bit)
    if x.is_cpu and x.dtype is _F32:
        ext = _build.ext()
        if ext is not None:  # the binding flattens leading dims
            return ext.int8_linear(x, qweight, scales, bias, x.shape[-1], tiles)
        _build.note_ref_path("int8_linear")
        out_shape = (*x.shape[:-1], qweight.shape[0])
        return int8_linear_ref(x.reshape(-1, x.shape[-1]), qweight, scales, bias).view(out_shape)
    if x.is_cuda and _triton.triton_available():
        return _triton.ops("int8_linear").int8_linear_triton(x, qweight, scales, bias)
    _build.note_fallback("int8_linear", _build.no_kernel_reason(x))
    return F.linear(x, dequantize_int8(qweight, scales, x.shape[-1]).to(x.dtype), bias)


__all__ = ["int8_linear", "int8_linear_ref", "int8_tiles"]
