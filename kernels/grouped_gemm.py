"""Grouped expert GEMM for MoE: one matrix product per expert over that expert's rows.

The rows of x are sorted by expert: expert e owns rows [offsets[e], offsets[e + 1]) and multiplies
them by its own weight w[e]:

    y[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]] @ w[e]^T        for every e

Worked example (E = 2, K = N = 1): x = [[1], [2], [3]], w = [[[10]], [[100]]], offsets = [0, 1, 3]
-> y = [[10], [200], [300]] (row 0 belongs to expert 0, rows 1-2 to expert 1). Experts with no rows
(offsets[e] == offsets[e + 1]) cost nothing, and no row is padded.

Why a kernel: the plain loop (`grouped_gemm_ref`) pays a Python-level slice + dispatch + MKL call
per expert. At decode sizes each expert sees a handful of rows and the product is bound by reading
w[e] (a GEMV): the C++ kernel streams each expert's weights once with the hand-written GEMV of
kernels/csrc/gemv.cpp (both cores, SIMD) for groups of up to GEMV_MAX_ROWS rows and calls MKL's GEMM
directly (no Python in the loop) for bigger groups, where the product is compute bound.

Dispatch: fp32 CPU tensors -> the C++ kernel; CUDA tensors -> the Triton kernel
(kernels/triton_ops/grouped_gemm.py) if triton is installed; anything else -> `grouped_gemm_ref`,
counted as a fallback.

Axes: M rows (token-expert assignments, sorted by expert), K input features, N output features,
E experts (local to this rank).
"""

from __future__ import annotations

import torch

from kernels import _build, _triton
from kernels.linear import GEMV_MAX_TOKENS

_F32 = torch.float32

# Groups with at most this many rows go through the GEMV kernel (kernels/linear.py explains the
# crossover), larger ones through MKL's GEMM.
GEMV_MAX_ROWS = GEMV_MAX_TOKENS


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # x [M, K], w [E, N, K], offsets [E + 1] (int, on any device) -> y [M, N]
    bounds = offsets.tolist()
    y = x.new_empty(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = x[lo:hi] @ w[e].T
    return y


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemm: x must be [M, K] and w [E, N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] + 1:
        raise ValueError(f"grouped_gemm: offsets must be [E + 1 = {w.shape[0] + 1}], got {tuple(offsets.shape)}")


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # x [M, K], w [E, N, K], offsets [E + 1] int64 (non-decreasing, offsets[0] = 0, offsets[E] = M) -> [M, N]
    _check(x, w, offsets)
    if x.is_cpu and x.dtype is _F32:
        ext = _build.ext()
        if ext is not None:
            return ext.grouped_gemm(x, w, offsets, GEMV_MAX_ROWS)
        _build.note_ref_path("grouped_gemm")
    elif x.is_cuda and _triton.triton_available():
        return _triton.ops("grouped_gemm").grouped_gemm_triton(x, w, offsets)
    else:
        _build.note_fallback("grouped_gemm", _build.no_kernel_reason(x))
    return grouped_gemm_ref(x, w, offsets)
