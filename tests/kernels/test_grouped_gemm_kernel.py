"""grouped_gemm (C++ kernel and Triton kernel in the interpreter) vs grouped_gemm_ref.

Shapes cover the MoE edge cases: experts with no rows (first, middle, last), a single row, uneven
groups on both sides of the GEMV/GEMM threshold (GEMV_MAX_ROWS), an empty batch, K and N that are
not multiples of the SIMD width. Tolerance: fp32 products of length K summed in a different order
(SIMD lanes / MKL blocking vs torch's matmul): rtol 1e-5, atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.grouped_gemm import GEMV_MAX_ROWS

from testkit.tolerance import KERNEL_FP32

CASES = [
    # (group sizes, N, K)
    ([1], 48, 32),
    ([0, 3, 0, 5], 40, 17),
    ([0, 0, 0], 16, 16),
    ([GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 2, 0, 40], 96, 64),
    ([7, 0, 1, 1, 0, 0, 2, 9], 33, 65),
]


def make(groups: list[int], n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(groups), k, generator=g)
    w = torch.randn(len(groups), n, k, generator=g) / k**0.5
    offsets = torch.tensor([0, *torch.tensor(groups).cumsum(0).tolist()], dtype=torch.long)
    return x, w, offsets


@pytest.mark.parametrize("groups,n,k", CASES)
def test_cpu_kernel_matches_ref(isa: str, groups, n, k) -> None:
    x, w, off = make(groups, n, k)
    KERNEL_FP32.assert_close(kernels.grouped_gemm(x, w, off), kernels.grouped_gemm_ref(x, w, off))


def test_ref_is_per_expert_matmul() -> None:
    x = torch.tensor([[1.0], [2.0], [3.0]])
    w = torch.tensor([[[10.0]], [[100.0]]])
    out = kernels.grouped_gemm_ref(x, w, torch.tensor([0, 1, 3]))
    assert out.tolist() == [[10.0], [200.0], [300.0]]


def test_strided_x(ext) -> None:
    x, w, off = make([2, 3], 24, 20)
    wide = torch.cat([x, torch.randn(5, 7)], dim=1)[:, :20]  # rows 27 floats apart
    KERNEL_FP32.assert_close(kernels.grouped_gemm(wide, w, off), kernels.grouped_gemm_ref(x, w, off))


def test_bad_offsets_raise(ext) -> None:
    x, w, _ = make([2, 2], 8, 8)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        kernels.grouped_gemm(x, w, torch.tensor([0, 5, 4]))
    with pytest.raises(RuntimeError, match="end at M"):
        kernels.grouped_gemm(x, w, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="E \\+ 1"):
        kernels.grouped_gemm(x, w, torch.tensor([0, 4]))


@pytest.mark.skipif(not kernels._triton.triton_available(), reason="the optional triton extra is not installed")
@pytest.mark.parametrize("groups,n,k", [([0, 3, 0, 5], 40, 17), ([1], 8, 8), ([17, 2, 0], 33, 40), ([0, 0], 8, 8)])
def test_triton_kernel_matches_ref(groups, n, k) -> None:
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"  # set session-wide by tests/conftest.py
    from kernels.triton_ops.grouped_gemm import grouped_gemm_triton

    x, w, off = make(groups, n, k, seed=1)
    KERNEL_FP32.assert_close(grouped_gemm_triton(x, w, off), kernels.grouped_gemm_ref(x, w, off))


# ------------------------------------------------------------------ dispatch


def test_dispatch_cpu_kernel_toggle_and_fallbacks(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = ext.grouped_gemm
    monkeypatch.setattr(ext, "grouped_gemm", lambda *a: calls.append("ext") or real(*a))
    x, w, off = make([2, 3], 8, 8)
    kernels.reset_fallback_counts()
    kernels.grouped_gemm(x, w, off)
    old = kernels.set_cpu_kernels_enabled(False)
    try:
        kernels.grouped_gemm(x, w, off)  # deliberate: the reference, not counted
    finally:
        kernels.set_cpu_kernels_enabled(old)
    assert calls == ["ext"] and kernels.fallback_counts() == {}
    out = kernels.grouped_gemm(x.bfloat16(), w.bfloat16(), off)
    assert out.dtype == torch.bfloat16 and calls == ["ext"]
    assert kernels.fallback_counts() == {"grouped_gemm:no kernel for cpu/torch.bfloat16": 1}


class _FakeCuda:
    """Just enough of a CUDA tensor for the wrapper's shape checks and dispatch."""

    is_cpu, is_cuda, dtype, device = False, True, torch.float32, torch.device("cuda")

    def __init__(self, *shape: int) -> None:
        self.shape = shape

    def dim(self) -> int:
        return len(self.shape)


@pytest.mark.parametrize("has_triton", [True, False])
def test_dispatch_cuda(monkeypatch: pytest.MonkeyPatch, has_triton: bool) -> None:
    import importlib
    import types

    from kernels import _triton

    mod = importlib.import_module("kernels.grouped_gemm")  # the package re-exports a function of that name

    calls: list[str] = []
    monkeypatch.setattr(_triton, "triton_available", lambda: has_triton)
    fake = types.SimpleNamespace(grouped_gemm_triton=lambda *a: calls.append("triton"))
    monkeypatch.setattr(_triton, "ops", lambda name: fake if name == "grouped_gemm" else pytest.fail(name))
    monkeypatch.setattr(mod, "grouped_gemm_ref", lambda *a: calls.append("ref"))
    kernels.reset_fallback_counts()
    mod.grouped_gemm(_FakeCuda(4, 8), _FakeCuda(2, 16, 8), _FakeCuda(3))
    assert calls == (["triton"] if has_triton else ["ref"])
    assert kernels.fallback_counts() == ({} if has_triton else {"grouped_gemm:triton unavailable": 1})
