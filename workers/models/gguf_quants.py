"""GGUF quantized blocks -> Duet's weight formats (kernels/quant_formats.py), from the integer codes.

Which GGUF type goes where (``native_weight``; every other supported type is de-quantized with the
``gguf`` package and handed to the layer as fp32, which quantizes it once):

    engine 'q4'    Q4_0, Q4_1   exact: the same 4-bit codes and fp16 (d, m) per 32-block
                   Q4_K         codes kept; each 32-weight sub-block's scale d * sc and min
                                -dmin * m (6-bit sc, m) are rounded once to fp16 (relative error
                                <= 2^-11 of the scale and of the min, far below one code step)
                   Q5_K, Q6_K   de-quantized, then quantized to q4 once (5 / 6 -> 4 bits: error up
                                to half a q4 step, (max - min) / 30 of each 32-block)
    engine 'int8'  Q8_0         codes rescaled from the 32-block scales d_b to the row's one scale
                                s = max_b |d_b| * max|q| / 127 (the int8 kernel has one scale per
                                row, so Q8_0's group layout does not fit it): q' = round(q d_b / s),
                                error <= s / 2, exactly what quantizing the de-quantized row gives
    engine 'none'  everything   de-quantized to fp32 (the converted checkpoint)

Layouts (ggml, little-endian; QK_K = 256 weights per super-block):
    Q4_0  18 B per 32: fp16 d, 16 B codes; w = d (q - 8)
    Q4_1  20 B per 32: fp16 d, fp16 m, 16 B codes; w = d q + m
    Q8_0  34 B per 32: fp16 d, 32 int8 q; w = d q
    Q4_K  144 B per 256: fp16 d, fp16 dmin, 12 B packed 6-bit (sc, m) x 8, 128 B codes in 4 groups of
          64 whose byte l holds weight l (low nibble) and l + 32 (high) - our q4 chunk order;
          w = d sc_j q - dmin m_j for sub-block j
In Q4_0 / Q4_1 byte j of a 32-block holds weights j (low) and j + 16 (high); the codes are
re-ordered into our chunk layout.

Axes: N rows (output features), K input features, B 32-weight blocks per row, S 256-weight
super-blocks per row.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.quant_formats import BLOCK, fp16_bits, pack_q4, padded_k
from workers.layers.quant_linear import QuantizedWeight

# GGUF tensor types Duet reads (any other is refused naming the file and the type)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K")
# (GGUF type, engine quantization) pairs loaded from their codes, not through fp32
NATIVE = {("Q4_0", "q4"), ("Q4_1", "q4"), ("Q4_K", "q4"), ("Q8_0", "int8")}


def native_weight(raw: torch.Tensor, K: int, kind: str, quantization: str) -> QuantizedWeight | None:
    """raw uint8 [N, bytes per row] of a GGUF tensor of type ``kind`` -> the engine format's
    QuantizedWeight [N, K], or None when (kind, quantization) has no native path."""
    if (kind, quantization) not in NATIVE:
        return None
    if kind == "Q4_K":
        return q4_from_q4k(raw, K)
    if kind == "Q8_0":
        return int8_from_q8_0(raw, K)
    return q4_from_gguf_blocks(raw, K, kind)


def _q4_weight(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, K: int) -> QuantizedWeight:
    """codes uint8 [N, B * 32], d and m float [N, B] -> QuantizedWeight q4 [N, K], padded to Kp."""
    N, nb = d.shape
    Kp = padded_k(K)
    q = torch.nn.functional.pad(q, (0, Kp - nb * BLOCK))
    pad_blocks = Kp // BLOCK - nb
    d = torch.nn.functional.pad(d.float(), (0, pad_blocks))
    m = torch.nn.functional.pad(m.float(), (0, pad_blocks))
    return QuantizedWeight("q4", (N, K), {"qweight": pack_q4(q), "scales": fp16_bits(d), "mins": fp16_bits(m)})


def q4_from_gguf_blocks(raw: torch.Tensor, K: int, kind: str) -> QuantizedWeight:
    """raw uint8 [N, B * 20] (Q4_1) or [N, B * 18] (Q4_0) -> QuantizedWeight q4 [N, K]."""
    N = raw.shape[0]
    nb = -(-K // BLOCK)
    per_block = 20 if kind == "Q4_1" else 18
    blocks = raw.reshape(N, nb, per_block)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(N, nb)  # [N, B]
    if kind == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).view(N, nb)
        qs = blocks[..., 4:]
    else:
        m = d * -8  # exact in fp16
        qs = blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(N, nb * BLOCK)  # [N, B * 32] codes 0..15
    return _q4_weight(q, d, m, K)


def _q4k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed uint8 [..., 12] -> (sc, m) int [..., 8]: 6-bit values, the first four in the low six
    bits of bytes 0..3 / 4..7, the last four split over bytes 8..11 (low / high nibble) and the
    top two bits of bytes 0..3 / 4..7 (ggml's get_scale_min_k4)."""
    p = packed.to(torch.int32)
    lo_d, lo_m, mix = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([lo_d & 0x3F, (mix & 0x0F) | ((lo_d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q4_from_q4k(raw: torch.Tensor, K: int) -> QuantizedWeight:
    """raw uint8 [N, S * 144] Q4_K -> QuantizedWeight q4 [N, K]: codes as they are, per 32-block
    d' = d sc_j and m' = -dmin m_j (rounded to fp16)."""
    N = raw.shape[0]
    assert K % 256 == 0, "K-quant rows are whole 256-weight super-blocks"
    S = K // 256
    blocks = raw.reshape(N, S, 144)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, S, 1]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    sc, mn = _q4k_scales(blocks[..., 4:16])  # [N, S, 8]
    qs = blocks[..., 16:].reshape(N, S, 4, 1, 32)  # 4 groups of 64 weights
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(N, K)  # [N, K]: low nibbles, then high
    return _q4_weight(q, (d * sc).reshape(N, S * 8), (-dmin * mn).reshape(N, S * 8), K)


def int8_from_q8_0(raw: torch.Tensor, K: int) -> QuantizedWeight:
    """raw uint8 [N, B * 34] Q8_0 -> QuantizedWeight int8 [N, K] on the row's scale (see above)."""
    N = raw.shape[0]
    nb = K // BLOCK
    blocks = raw.reshape(N, nb, 34)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, B, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [N, B, 32]
    amax = (d.abs() * q.abs().amax(-1, keepdim=True)).amax(dim=1).reshape(N)  # [N]
    scales = amax / 127
    inv = torch.where(amax > 0, 1 / scales, torch.zeros_like(scales))
    codes = torch.round(q * (d * inv[:, None, None])).clamp_(-127, 127).to(torch.int8).reshape(N, K)
    codes = torch.nn.functional.pad(codes, (0, padded_k(K) - K))
    return QuantizedWeight("int8", (N, K), {"qweight": codes.contiguous(), "scales": scales.contiguous()})


def dequantize_raw(raw: np.ndarray, kind: str, shape: list[int]) -> torch.Tensor:
    """A GGUF tensor of any supported type -> fp32 [shape] (the ``gguf`` package's de-quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32)).reshape(shape)
