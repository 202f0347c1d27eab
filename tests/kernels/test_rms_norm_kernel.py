"""rms_norm C++ kernel vs rms_norm_ref.

Tolerance: the kernel sums r^2 in vector lanes (a different order than torch), so mean(r^2) differs
by a few ulp and so does every output: KERNEL_FP32 (1e-5) on outputs of size ~1 is ~100 ulp of
headroom, far below any real bug. The residual sum r = x + residual is one exact-order add: equal.
"""

from __future__ import annotations

import pytest
import torch

import kernels

from testkit.tolerance import KERNEL_FP32


@pytest.mark.parametrize("T,E", [(1, 576), (4, 576), (3, 1), (2, 17), (5, 100), (300, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_ref(isa: str, T: int, E: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(T * 1000 + E)
    x = torch.randn(T, E, generator=g)
    w = torch.rand(E, generator=g) + 0.5
    res = torch.randn(T, E, generator=g) if with_residual else None
    out, new_res = kernels.rms_norm(x, w, 1e-5, res)
    ref_out, ref_res = kernels.rms_norm_ref(x, w, 1e-5, res)
    KERNEL_FP32.assert_close(out, ref_out)
    if with_residual:
        assert torch.equal(new_res, ref_res)
    else:
        assert new_res is None


def test_matches_hf_llama_formula(ext) -> None:
    # HF LlamaRMSNorm: weight * (h * rsqrt(mean(h^2) + eps)) in fp32.
    x = torch.randn(2, 576) * 3
    w = torch.randn(576)
    hf = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    KERNEL_FP32.assert_close(kernels.rms_norm(x, w, 1e-6)[0], hf)


def test_strided_rows_and_leading_dims(ext) -> None:
    base = torch.randn(3, 2 * 576)
    x = base[:, :576]  # rows 1152 floats apart, as a slice of a fused projection would be
    w = torch.randn(576)
    KERNEL_FP32.assert_close(kernels.rms_norm(x, w, 1e-5)[0], kernels.rms_norm_ref(x, w, 1e-5)[0])
    x3 = torch.randn(2, 3, 64)
    out, _ = kernels.rms_norm(x3, torch.ones(64), 1e-5)
    assert out.shape == (2, 3, 64)
    KERNEL_FP32.assert_close(out, kernels.rms_norm_ref(x3, torch.ones(64), 1e-5)[0])


def test_inputs_not_modified(ext) -> None:
    x, r, w = torch.randn(2, 576), torch.randn(2, 576), torch.randn(576)
    x0, r0 = x.clone(), r.clone()
    kernels.rms_norm(x, w, 1e-5, r)
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_bad_weight_shape_raises(ext) -> None:
    with pytest.raises(RuntimeError, match="weight"):
        ext.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5, None)
