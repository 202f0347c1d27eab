"""Triton batched LoRA (math: kernels/lora.py): y[t] += scales[s] * (x[t] @ A[s]^T) @ B[s]^T, s = idx[t].

One fused kernel, gathered per token (the "BGMV" shape of punica / S-LoRA): grid (T, column tiles).
Program (t, j) reads token t's slot s (s < 0: the base model, the program exits at once), computes
the rank-R intermediate h = scales[s] * x[t] @ A[s]^T in fp32 (R <= BR, a power of two; x streamed
in BK-wide tiles), then adds h @ B[s][cols]^T to y[t, cols] for its BN columns. Every column tile
of a token recomputes h (R K multiply-adds, small next to the tile's own BN R for R << K): the
price of needing no sort of the tokens by slot and no intermediate buffer. Accumulates in fp32,
stores in y's dtype (y is updated in place: each (t, column) has exactly one writer).

Axes: T tokens, K input features, N output features, R rank (slots zero-padded to it), S slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2

BN, BK = 64, 64


@triton.jit
def _lora_kernel(x_ptr, a_ptr, b_ptr, s_ptr, idx_ptr, y_ptr, N, K, R, x_st, a_ss, a_sr, b_ss, b_sn, y_st,
                 BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    if slot >= 0:
        rs = tl.arange(0, BR)
        rm = rs < R
        h = tl.zeros((BR,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            km = ks < K
            xv = tl.load(x_ptr + t * x_st + ks, mask=km, other=0.0).to(tl.float32)  # [BK]
            av = tl.load(a_ptr + slot * a_ss + rs[:, None] * a_sr + ks[None, :], mask=rm[:, None] & km[None, :],
                         other=0.0).to(tl.float32)  # [BR, BK]
            h += tl.sum(av * xv[None, :], axis=1)
        h = h * tl.load(s_ptr + slot).to(tl.float32)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < N
        bv = tl.load(b_ptr + slot * b_ss + cols[:, None] * b_sn + rs[None, :], mask=cm[:, None] & rm[None, :],
                     other=0.0).to(tl.float32)  # [BN, BR]
        delta = tl.sum(bv * h[None, :], axis=1)  # [BN]
        yp = y_ptr + t * y_st + cols
        yv = tl.load(yp, mask=cm, other=0.0).to(tl.float32)
        tl.store(yp, (yv + delta).to(y_ptr.dtype.element_ty), mask=cm)


def lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                idx: torch.Tensor) -> torch.Tensor:
    # y [T, N] (in place, returned), x [T, K], a [S, R, K], b [S, N, R], scales [S], idx [T] (-1 = base)
    check_device(x, "lora")
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    assert y.stride(-1) == 1, "lora: y's rows must be contiguous (it is updated in place)"
    T, K = x.shape
    _, R, _ = a.shape
    N = y.shape[1]
    if T and N and R:
        idx = idx.to(device=x.device, dtype=torch.int64).contiguous()
        grid = (T, triton.cdiv(N, BN))
        _lora_kernel[grid](x, a, b, scales.contiguous(), idx, y, N, K, R, x.stride(0), a.stride(0), a.stride(1),
                           b.stride(0), b.stride(1), y.stride(0), BR=max(16, next_pow2(R)), BN=BN, BK=BK)
    return y
