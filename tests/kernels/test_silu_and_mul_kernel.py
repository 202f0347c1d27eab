"""silu_and_mul C++ kernel vs silu_and_mul_ref.

Tolerance: the kernel's vector exp is a degree-6 polynomial accurate to ~1-2 ulp, then one divide
and one multiply, so each output is within a few ulp of torch's: rtol 1e-6 (~8 ulp). atol 1e-30
only covers gates below -87, where the kernel's clamped exp gives ~1e-37 instead of a denormal.
"""

from __future__ import annotations

import pytest
import torch

import kernels

from testkit.tolerance import ELEMENTWISE_FP32_RELATIVE


@pytest.mark.parametrize("T,I", [(1, 1536), (4, 1536), (1, 1), (3, 17), (200, 1536)])
def test_matches_ref(isa: str, T: int, I: int) -> None:
    g = torch.Generator().manual_seed(T * 7 + I)
    x = torch.randn(T, 2 * I, generator=g) * 4
    ELEMENTWISE_FP32_RELATIVE.assert_close(kernels.silu_and_mul(x), kernels.silu_and_mul_ref(x))


def test_extreme_gates(isa: str) -> None:
    gate = torch.tensor([-1000.0, -100.0, -88.0, -20.0, -1.2785, -1e-20, 0.0, 1e-20, 3.0, 20.0, 88.0, 100.0, 1e4, 3e38])
    x = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0)
    ELEMENTWISE_FP32_RELATIVE.assert_close(kernels.silu_and_mul(x), kernels.silu_and_mul_ref(x))


def test_strided_rows(ext) -> None:
    base = torch.randn(3, 4000)
    x = base[:, 100:3172]  # [3, 3072], rows 4000 floats apart
    ELEMENTWISE_FP32_RELATIVE.assert_close(kernels.silu_and_mul(x), kernels.silu_and_mul_ref(x))


def test_odd_width_raises(ext) -> None:
    with pytest.raises(RuntimeError, match="2I"):
        ext.silu_and_mul(torch.randn(2, 5))
