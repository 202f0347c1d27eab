"""What this CPU computes natively, as far as the choice of a dtype and a kernel path is concerned.

Two probes that agree (tests/kernels/test_cpu_features.py checks it):
  - the C++ kernels pick their code per call from ``__builtin_cpu_supports`` (kernels/csrc/isa.cpp):
    the bf16 GEMV uses AVX512-BF16's vdpbf16ps where the CPU has it, else widens bf16 to fp32 and
    FMAs (plain AVX-512) or runs scalar code; the int8 / q4 kernels use AVX512-VNNI's vpdpbusd
    where the CPU has it, else AVX2 integer code (also on AVX-512 CPUs without VNNI) or scalar code.
    Results are the same float sequence on every path (bit-identical for int8 / q4).
  - this module reads torch's cpuinfo probe (the one oneDNN dispatches on), so it needs no build of
    the kernels: ``features()`` lists what the CPU has, and ``fast_bf16()`` says whether bf16 matrix
    products run natively (AVX512-BF16 or AMX tiles with bf16 dot products: oneDNN's bf16 GEMM behind
    ``F.linear`` and the bf16 GEMV then run at least as fast as fp32 while reading half the bytes).
    ``dtype: auto`` consults it (workers/engine/device.py).

``DUET_CPU_BF16=0`` (or ``1``) overrides ``fast_bf16()`` for ``dtype: auto`` -- the test suite sets 0 so
its float32 comparisons run float32 on every CPU, as on CI machines without AVX512-BF16; the bf16
paths have their own tests with an explicit dtype. Any other value is refused.

Worked example: on a Sapphire Rapids Xeon ``features()`` is CpuFeatures(avx2=True, avx512=True,
avx512_bf16=True, avx512_vnni=True, amx=True) and ``fast_bf16()`` True; on a Skylake-SP Xeon
(AVX-512 without BF16) avx512_bf16 and amx are False and ``fast_bf16()`` False.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

ENV_FAST_BF16 = "DUET_CPU_BF16"


@dataclass(frozen=True)
class CpuFeatures:
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    avx512_vnni: bool
    amx: bool  # AMX tiles (AMX-BF16 / AMX-INT8 come with them on every CPU that has them)


@functools.cache
def features() -> CpuFeatures:
    import torch

    cpu = torch.cpu
    return CpuFeatures(
        avx2=bool(cpu._is_avx2_supported()),
        avx512=bool(cpu._is_avx512_supported()),
        avx512_bf16=bool(cpu._is_avx512_bf16_supported()),
        avx512_vnni=bool(cpu._is_vnni_supported()),
        amx=bool(cpu._is_amx_tile_supported()),
    )


def fast_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX (bf16 is then the faster dtype for unquantized
    weights), unless DUET_CPU_BF16 says otherwise."""
    forced = os.environ.get(ENV_FAST_BF16, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{ENV_FAST_BF16}={forced!r}: must be 0 or 1 (or unset: ask the CPU)")
        return forced == "1"
    f = features()
    return f.avx512_bf16 or f.amx


__all__ = ["ENV_FAST_BF16", "CpuFeatures", "features", "fast_bf16"]
