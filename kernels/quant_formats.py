"""Weight formats of the quantized linear kernels: quantize, pack, unpack, dequantize (pure torch).

Terms:
    block   32 consecutive weights of one output row (along K) sharing a scale, as in GGUF.
    chunk   two blocks (64 weights): what one AVX-512 register of int8 holds. K is padded with
            zeros to Kp = ceil(K / 64) * 64 so every row is whole chunks.
    int8    symmetric per-output-channel: w[n, k] ~= scales[n] * q[n, k], q in -127..127,
            scales[n] = max_k |w[n, k]| / 127. Stored q int8 [N, Kp], scales fp32 [N].
    q4      asymmetric per block (GGUF Q4_1's math): w ~= d * q + m, q in 0..15, d = (max - min) / 15,
            m = min, d and m rounded to fp16. Stored packed q uint8 [N, Kp / 2] (byte j of chunk c
            = q[64c + j] | q[64c + 32 + j] << 4, so one 32-byte load unpacks to the chunk in order),
            d and m as fp16 bit patterns in int16 tensors [N, Kp / 32] (int16 so that
            ``module.to(dtype)`` leaves them alone). GGUF Q4_0 (w = d * (q - 8)) is the same math
            with m = -8 d.

Worked example (int8): w = [[0.5, -1.0]] -> scales = [1/127], q = [[64, -127]] (0.5 * 127 = 63.5
rounds half to even -> 64), dequantized [[0.5039, -1.0]].

Axes: N output features (rows), K input features, Kp padded K, B = Kp / 32 blocks per row.
"""

from __future__ import annotations

import torch

BLOCK = 32
CHUNK = 64


def padded_k(K: int) -> int:
    """Columns a quantized row stores: K rounded up to a whole chunk."""
    return -(-K // CHUNK) * CHUNK


def _pad_cols(w: torch.Tensor, Kp: int, value: float = 0.0) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, Kp - w.shape[-1]), value=value)


# ------------------------------------------------------------------------------------- int8
def quantize_int8(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, Kp], scales fp32 [N]). ``amax`` [N]: max |w| of each row of a
    wider matrix that w is a column slice of (a tensor-parallel shard keeps the full row's scale);
    default w's own."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1) if amax is None else amax.float()  # [N]
    scales = amax / 127
    inv = torch.where(amax > 0, 1 / scales, torch.zeros_like(scales))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return _pad_cols(q, padded_k(w.shape[1])).contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
    """(q int8 [N, Kp], scales [N]) -> w fp32 [N, K]."""
    return q[:, :K].float() * scales[:, None]


# --------------------------------------------------------------------------------------- q4
def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, Kp] (values 0..15) -> packed uint8 [N, Kp / 2] (see the module docstring)."""
    N, Kp = q.shape
    assert Kp % CHUNK == 0, Kp
    halves = q.view(N, Kp // CHUNK, 2, BLOCK)  # [N, chunks, lo/hi, 32]
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(N, Kp // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, Kp / 2] -> q uint8 [N, Kp]."""
    N, half = packed.shape
    chunks = packed.view(N, half // BLOCK, 1, BLOCK)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(N, 2 * half)


def fp16_bits(t: torch.Tensor) -> torch.Tensor:
    """float tensor -> its fp16 bit patterns as int16 (the storage of q4 scales and mins)."""
    return t.to(torch.float16).view(torch.int16).contiguous()


def from_fp16_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float16).float()


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (packed uint8 [N, Kp / 2], d int16 [N, B], m int16 [N, B]).

    Per block: m = min, d = (max - min) / 15, both rounded to fp16 first; then
    q = clamp(round((w - m) / d), 0, 15). Padding (k >= K) takes no part in min/max; a block made
    only of padding gets d = m = 0.
    """
    w = w.detach().float()
    N, K = w.shape
    Kp = padded_k(K)
    blocks = _pad_cols(w, Kp, float("nan")).view(N, Kp // BLOCK, BLOCK)  # [N, B, 32], padding nan
    real = ~blocks.isnan()
    lo = torch.where(real, blocks, torch.inf).amin(-1)  # [N, B]
    hi = torch.where(real, blocks, -torch.inf).amax(-1)
    empty = ~real.any(-1)
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    d = ((hi - lo) / 15).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((blocks.nan_to_num(0.0) - m[..., None]) * inv[..., None]).clamp_(0, 15)
    q = q.masked_fill(~real, 0).to(torch.uint8).view(N, Kp)
    return pack_q4(q), fp16_bits(d), fp16_bits(m)


def dequantize_q4(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, K: int) -> torch.Tensor:
    """(packed [N, Kp / 2], d, m int16 fp16-bits [N, B]) -> w fp32 [N, K]."""
    q = unpack_q4(packed).float()  # [N, Kp]
    N, Kp = q.shape
    w = q.view(N, Kp // BLOCK, BLOCK) * from_fp16_bits(d)[..., None] + from_fp16_bits(m)[..., None]
    return w.view(N, Kp)[:, :K]
