"""Triton grouped expert GEMM (math: kernels/grouped_gemm.py): y[rows of e] = x[rows of e] @ w[e]^T.

Grid: (E, row tiles, column tiles). Program (e, i, j) computes rows offsets[e] + i*BM .. + BM (clipped
to the expert's end) and columns j*BN .. + BN; tiles past an expert's rows exit at once. The row-tile
count is sized for the whole batch (M rows) so no host sync reads the offsets; the empty programs
cost a launch slot each, not memory traffic. Accumulates in fp32, stores in x's dtype.

Axes: M rows (sorted by expert), K input features, N output features, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device

BM, BN, BK = 16, 32, 32


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, off_ptr, y_ptr, N, K, x_st, w_se, w_sn, y_st,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    m0 = start + tl.program_id(1) * BM
    if m0 < end:
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        rm = rows < end
        cols = tl.program_id(2) * BN + tl.arange(0, BN)
        cm = cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            km = ks < K
            a = tl.load(x_ptr + rows[:, None] * x_st + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_ptr + e.to(tl.int64) * w_se + cols[None, :] * w_sn + ks[:, None],
                        mask=km[:, None] & cm[None, :], other=0.0)  # [BK, BN] = w[e]^T tile
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")  # no TF32 rounding
        tl.store(y_ptr + rows[:, None] * y_st + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


def grouped_gemm_triton(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # x [M, K], w [E, N, K], offsets [E + 1] -> y [M, N]
    check_device(x, "grouped_gemm")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M, K = x.shape
    E, N, _ = w.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        off = offsets.to(device=x.device, dtype=torch.int64).contiguous()
        grid = (E, triton.cdiv(M, BM), triton.cdiv(N, BN))
        _grouped_gemm_kernel[grid](x, w, off, y, N, K, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
                                   BM=BM, BN=BN, BK=BK)
    return y
