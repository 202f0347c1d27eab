"""What this CPU computes natively, as far as the choice of a dtype is concerned.

``fast_bf16()``: True when the CPU has AVX512-BF16 or AMX (tiles with bf16 dot products), i.e. when
bf16 matrix products (oneDNN's GEMM behind ``F.linear``, the bf16 GEMV of kernels/linear.py) run
at least as fast as fp32 ones while reading half the bytes. Read through torch's cpuinfo probe
(the same one oneDNN dispatches on), so it needs no build of the C++ kernels. ``dtype: auto``
(workers/engine/device.py) consults it; the kernels themselves pick their code paths at run time
(kernels/csrc/common.h).
"""

from __future__ import annotations

import functools


@functools.cache
def fast_bf16() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


__all__ = ["fast_bf16"]
