"""Weight-only int8 linear: y = x W^T (+ b), W int8 with one fp32 scale per output row, x fp32.

Terms: ``qweight`` int8 [N, Kp] and ``scales`` fp32 [N] are kernels/quant_formats.py's int8 format
(w[n, k] ~= scales[n] * qweight[n, k], K zero-padded to Kp, a multiple of 64). "Weight-only": the
activations are not quantized, so the product is x @ dequant(W)^T up to fp32 rounding; only the
weights' bytes shrink (1 byte each, 1/4 of fp32), which is what batch-1 decode pays for.

Kernel (kernels/csrc/int8_linear.cpp): each int8 weight is widened to fp32 (exact) and FMA'd with
x; OpenMP over 16-row tiles, up to 8 tokens per pass over a tile held in L1, x walked in blocks of
<= 256 KB, so a weight row is read from memory once per call at decode sizes (once per token block
in a long prefill); the next rows are prefetched. AVX-512, AVX2 and scalar paths, chosen at run time.

Batch invariance: every output element is accumulated in one fixed order (per ISA path), so a
token's row of y is bit-identical whether it is computed alone or inside any batch (speculative
verification and continuous batching rely on it); tests/kernels/test_int8_linear_kernel.py checks it.

Reference: ``int8_linear_ref`` computes scales[n] * (x . q[n]) (+ b) in float64, rounded to fp32 at
the end; the kernel matches it up to fp32 accumulation error.

Dispatch: fp32 CPU x -> C++ kernel; CPU with the kernels disabled -> the reference; CUDA -> the
Triton kernel (kernels/triton_ops/int8_linear.py) when triton is installed, else dequantize +
F.linear, counted as a fallback.

Worked example: x = [[1, 2]], W = [[1, 0], [0, 1], [1, 1]] -> scales = [1/127] * 3, q = 127 * W
-> y = [[1, 2, 3]] (each up to fp32 rounding of 127 * (1/127)).

Axes: T tokens, K input features, Kp padded K, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _build, _triton
from kernels.quant_formats import dequantize_int8

_F32 = torch.float32


def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, K], qweight int8 [N, Kp], scales [N], bias [N] -> [T, N]
    K = x.shape[-1]
    y = (x.double() @ qweight[:, :K].double().T) * scales.double()  # [T, N]
    return (y if bias is None else y + bias.double()).float()


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [..., K], qweight int8 [N, Kp], scales [N], bias [N] -> [..., N]
    if x.is_cpu and x.dtype is _F32:
        ext = _build.ext()
        if ext is not None:  # the binding flattens leading dims
            return ext.int8_linear(x, qweight, scales, bias, x.shape[-1])
        _build.note_ref_path("int8_linear")
        out_shape = (*x.shape[:-1], qweight.shape[0])
        return int8_linear_ref(x.reshape(-1, x.shape[-1]), qweight, scales, bias).view(out_shape)
    if x.is_cuda and _triton.triton_available():
        return _triton.ops("int8_linear").int8_linear_triton(x, qweight, scales, bias)
    _build.note_fallback("int8_linear", _build.no_kernel_reason(x))
    return F.linear(x, dequantize_int8(qweight, scales, x.shape[-1]).to(x.dtype), bias)


__all__ = ["int8_linear", "int8_linear_ref"]
