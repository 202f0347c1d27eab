"""linear (C++ GEMV for T <= GEMV_MAX_TOKENS) vs linear_ref (F.linear).

Tolerance: both are fp32 sums of K products in different orders (vector lanes + a tree vs MKL's
blocking). With W ~ N(0, 1/K) the outputs are ~N(0, 1) and the reordering difference is about
sqrt(K) ulp ~ 1e-6 at K = 1536: rtol 1e-5 / atol 1e-5 leaves a 10x margin and catches any wrong
row, column or tail.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.linear import GEMV_MAX_TOKENS

from testkit.tolerance import KERNEL_FP32

# SmolLM2-135M's matrices (qkv, o, gate_up, down) plus awkward sizes: K not a multiple of 16, N not
# a multiple of the 8-row block, tiny and single-element cases.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 577), (1000, 33), (5, 15), (1, 1), (9, 16)]


def _weights(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 11, 16])
def test_matches_ref(isa: str, T: int, N: int, K: int) -> None:
    w, b = _weights(N, K, N * K + T)
    x = torch.randn(T, K)
    KERNEL_FP32.assert_close(kernels.linear(x, w), kernels.linear_ref(x, w))
    KERNEL_FP32.assert_close(kernels.linear(x, w, b), kernels.linear_ref(x, w, b))


def test_lm_head_shape(ext) -> None:
    w, _ = _weights(49152, 576, 0)
    x = torch.randn(1, 576)
    KERNEL_FP32.assert_close(kernels.linear(x, w), kernels.linear_ref(x, w))


@pytest.mark.parametrize("T", [17, 30])
def test_kernel_handles_any_T(ext, T: int) -> None:
    # The wrapper sends T > GEMV_MAX_TOKENS to F.linear, but the kernel itself loops in 8-row passes.
    w, b = _weights(100, 70, T)
    x = torch.randn(T, 70)
    KERNEL_FP32.assert_close(ext.gemv(x, w, b), kernels.linear_ref(x, w, b))


def test_routing_by_T(ext) -> None:
    # T <= GEMV_MAX_TOKENS runs the GEMV kernel, larger T runs at::linear (MKL): each path is
    # deterministic, and the two sum in different orders, so bitwise equality tells them apart.
    w, _ = _weights(64, 200, 1)
    for T in (1, GEMV_MAX_TOKENS):
        x = torch.randn(T, 200)
        assert torch.equal(kernels.linear(x, w), ext.gemv(x, w, None))
    x = torch.randn(GEMV_MAX_TOKENS + 1, 200)
    assert torch.equal(kernels.linear(x, w), torch.nn.functional.linear(x, w))
    assert not torch.equal(ext.gemv(x, w, None), torch.nn.functional.linear(x, w))


def test_strided_x_and_leading_dims(ext) -> None:
    w, b = _weights(64, 48, 3)
    base = torch.randn(2, 100)
    x = base[:, 10:58]  # rows 100 floats apart
    KERNEL_FP32.assert_close(kernels.linear(x, w, b), kernels.linear_ref(x, w, b))
    xt = torch.randn(48, 2).t()  # column-major: the binding makes it contiguous
    KERNEL_FP32.assert_close(kernels.linear(xt, w, b), kernels.linear_ref(xt, w, b))
    x3 = torch.randn(1, 3, 48)
    KERNEL_FP32.assert_close(kernels.linear(x3, w, b), kernels.linear_ref(x3, w, b))


def test_shape_mismatch_raises(ext) -> None:
    with pytest.raises(RuntimeError, match="K"):
        ext.gemv(torch.randn(1, 8), torch.randn(4, 9), None)
