"""Quantized linear with 4-bit weights: y = x W^T (+ b), W in q4 (see kernels/quant_formats.py).

Batch-1 decode reads every weight once per token, so bytes per weight bound its speed: q4 reads
~5/32 of fp32's bytes (4-bit codes + fp16 scale and min per 32 weights). The C++ kernel
(kernels/csrc/quant_linear.cpp) also quantizes x per block of 32 to int8 on the fly (as llama.cpp
does for its Q8 activations), so each block's dot product is an exact integer sum, done 64 products
per AVX-512 VNNI instruction (AVX2 integer code on CPUs without VNNI, AVX-512 ones included); one
kernel serves every T (rows of W are streamed once per call; tokens go 4 at a time over a pair of
16-row tiles held in cache), from batch-1 decode to a 512-token prefill. int8 weights share the
kernel and the activation quantization (kernels/int8_linear.py).

References:
    ``q4_linear_ref`` computes exactly what the kernel computes (same activation quantization,
    integer block dots, then float64 scaling): the kernel must match it to float rounding.
    ``dequantize_q4`` + ``F.linear`` is the weight-only product (x not quantized); the kernel
    differs from it by the activation rounding alone.

Dispatch: fp32 CPU x -> C++ kernel (AVX-512 VNNI, AVX2 or scalar path chosen at run time); CPU with
the kernels disabled -> the reference; CUDA -> the Triton kernel (kernels/triton_ops/quant_linear.py:
weight-only, x stays in its dtype; its reference is dequantize + F.linear) when triton is installed,
else dequantize + F.linear, counted as a fallback.

Worked example: x = [[1, 2]] and one row w = [1, 1] (one block: d = 1, m = 0, codes [1, 1]): x's
block scale is 2/127, xq = [64, 127] (the 1 became 64/63.5) -> y ~= 2/127 * (64 + 127) = 3.0079.

Axes: T tokens, K input features, Kp padded K, N output features, B = Kp / 32 blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _build, _triton
from kernels.quant_formats import BLOCK, dequantize_q4, from_fp16_bits, padded_k, unpack_q4

_F32 = torch.float32


def quantize_activations_ref(x: torch.Tensor, Kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq int8 [T, Kp], sx fp32 [T, B]): per block of 32, sx = max|x| / 127 and
    xq = round_half_even(x * (1 / sx)); the float ops the kernel uses, so results are identical."""
    T, K = x.shape
    blocks = F.pad(x.float(), (0, Kp - K)).view(T, Kp // BLOCK, BLOCK)  # [T, B, 32]
    amax = blocks.abs().amax(-1)  # [T, B]
    sx = amax / 127
    inv = torch.where(amax > 0, 1 / sx, torch.zeros_like(sx))
    xq = torch.round(blocks * inv[..., None]).to(torch.int8).view(T, Kp)
    return xq, sx


def _block_dots(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [T, Kp], wq [N, Kp] integer codes -> exact per-block dots [T, N, B] (float64)."""
    T, Kp = xq.shape
    xb = xq.double().view(T, Kp // BLOCK, BLOCK)
    wb = wq.double().view(wq.shape[0], Kp // BLOCK, BLOCK)
    return torch.einsum("tbk,nbk->tnb", xb, wb)


def q4_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x [T, K], qweight uint8 [N, Kp / 2], d / m int16 fp16-bits [N, B] -> [T, N]
    xq, sx = quantize_activations_ref(x, 2 * qweight.shape[1])
    T = xq.shape[0]
    xs = sx.double() * xq.double().view(T, -1, BLOCK).sum(-1)  # [T, B]: sx * sum(xq) per block
    dd, mm = from_fp16_bits(d).double(), from_fp16_bits(m).double()  # [N, B]
    y = (_block_dots(xq, unpack_q4(qweight)) * sx.double()[:, None, :] * dd).sum(-1) + xs @ mm.T  # [T, N]
    return (y if bias is None else y + bias.double()).float()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def quant_tiles_used() -> bool:
    """Whether the CPU kernel reads ``q4_tiles`` / ``int8_tiles`` (kernels/int8_linear.py): its
    AVX-512 VNNI path is the one taken; every other path reads the weights in their own format and
    ignores tiles."""
    ext = _build.ext()
    return ext is not None and ext.quant_path() == "avx512_vnni"


def q4_tiles(qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """The weights in the AVX-512 VNNI path's tile order (uint8 [ceil(N / 16), 10 Kp]: the same
    bytes, permuted; kernels/csrc/kernels.h ``make_q4_tiles``), for ``q4_linear(..., tiles=)``; None
    without the C++ kernels or for a weight off the CPU.

    Why: without them that path repacks every 16-row tile into its scratch on every call, which
    costs batch-1 decode more than streaming the weights does (worth making only where
    ``quant_tiles_used()``). The copy costs the codes' and scales' memory again (~4.5 bits per weight)."""
    ext = _build.ext()
    if ext is None or not qweight.is_cpu:
        return None
    return ext.q4_tiles(qweight.contiguous(), d.contiguous(), m.contiguous())


def q4_linear(
    x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    # x [..., K], qweight uint8 [N, Kp / 2], d / m int16 [N, B], bias [N] -> [..., N]
    # tiles: q4_tiles(qweight, d, m) or None; the same result either way (bit for bit)
    if x.is_cpu and x.dtype is _F32:
        ext = _build.ext()
        if ext is not None:  # the binding flattens leading dims
            return ext.q4_linear(x, qweight, d, m, bias, x.shape[-1], tiles)
        out_shape = (*x.shape[:-1], qweight.shape[0])
        _build.note_ref_path("q4_linear")
        return q4_linear_ref(_rows(x), qweight, d, m, bias).view(out_shape)
    if x.is_cuda and _triton.triton_available():
        return _triton.ops("quant_linear").q4_linear_triton(x, qweight, d, m, bias)
    _build.note_fallback("q4_linear", _build.no_kernel_reason(x))
    return F.linear(x, dequantize_q4(qweight, d, m, x.shape[-1]).to(x.dtype), bias)


__all__ = [
    "padded_k",
    "q4_linear",
    "q4_linear_ref",
    "q4_tiles",
    "quant_tiles_used",
    "quantize_activations_ref",
]
