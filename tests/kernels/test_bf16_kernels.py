"""The bf16 paths of the CPU kernels (a bf16 model's ops) vs their torch references, on every ISA path
(AVX-512 with AVX512-BF16 where the CPU has it, the plain AVX-512 fallback a CPU without it takes --
forced here with set_dot_extensions(False) -- and the scalar code that bf16 runs on AVX2 and scalar CPUs).

How close each must be:
  - rotary_and_cache_write rounds each product and sum to bf16 exactly where torch's bf16 ops do:
    bit-identical, the cache writes too.
  - rms_norm: the residual sum is one rounded add, bit-identical; the output rounds twice (the
    normalised row, then its product with the weight) from fp32 values that may differ from the
    reference's in the last fp32 bits (summation order, 1 / sqrt vs rsqrt), so each rounding may
    land one bf16 step apart: within 2 bf16 units of roundoff of the result.
  - silu_and_mul: the same, two roundings.
  - linear (GEMV and oneDNN), paged decode and varlen attention: fp32 accumulation, one rounding to
    bf16 at the end: within the float32 error bound of the sums plus one bf16 rounding of the result,
    against float64 math on the same bf16 inputs.
The bounds (and U_BF16 = 2^-8, bf16's unit roundoff) are tests/testkit/tolerance.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.linear import BF16_GEMV_MAX_TOKENS
from testkit.kernel_paths import available_paths, on_path
from testkit.tolerance import assert_within as _assert_within
from testkit.tolerance import bf16_attention_error_bound, bf16_linear_error_bound, bf16_rounding_bound

BF = torch.bfloat16


def _rand(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(BF)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: np.ndarray, what: str) -> None:
    _assert_within(got.double(), want.double(), bound, what)  # numpy has no bf16


def _abs_max(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max())


@pytest.mark.parametrize("T,E", [(1, 576), (5, 100), (3, 17)])
def test_rms_norm(isa: str, T: int, E: int) -> None:
    g = torch.Generator().manual_seed(T * E)
    x, res, w = _rand(T, E, g=g), _rand(T, E, g=g), _rand(E, g=g, scale=0.3) + 1
    out, r = kernels.rms_norm(x, w, 1e-5, res)
    want, r_want = kernels.rms_norm_ref(x, w, 1e-5, res)
    assert out.dtype == BF and torch.equal(r, r_want)
    assert_within(out, want, bf16_rounding_bound(want, 2), "rms_norm (residual)")
    out, none = kernels.rms_norm(x, w, 1e-5)
    assert none is None
    want = kernels.rms_norm_ref(x, w, 1e-5)[0]
    assert_within(out, want, bf16_rounding_bound(want, 2), "rms_norm")


@pytest.mark.parametrize("T,I", [(1, 1536), (4, 37)])
def test_silu_and_mul(isa: str, T: int, I: int) -> None:
    x = _rand(T, 2 * I, g=torch.Generator().manual_seed(I), scale=3)
    want = kernels.silu_and_mul_ref(x)
    assert_within(kernels.silu_and_mul(x), want, bf16_rounding_bound(want, 2), "silu_and_mul")


def test_rotary_and_cache_write_is_bit_identical(isa: str) -> None:
    g = torch.Generator().manual_seed(2)
    T, H, G, D, S = 5, 6, 2, 64, 40
    q, k, v = _rand(T, H, D, g=g), _rand(T, G, D, g=g), _rand(T, G, D, g=g)
    ang = torch.randn(T, D // 2, generator=g)
    cos, sin = ang.cos().to(BF), ang.sin().to(BF)
    slots = torch.tensor([3, 17, -1, 0, 39])
    kc, vc = torch.zeros(S, G, D, dtype=BF), torch.zeros(S, G, D, dtype=BF)
    q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
    kernels.rotary_and_cache_write(q, k, v, cos, sin, kc, vc, slots)
    kernels.rotary_and_cache_write_ref(q2, k2, v, cos, sin, kc2, vc2, slots)
    for got, want in ((q, q2), (k, k2), (kc, kc2), (vc, vc2)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (5, 15)])
def test_linear(dot_path: str, T: int, N: int, K: int) -> None:
    # T <= BF16_GEMV_MAX_TOKENS: the GEMV kernel; above: at::linear (oneDNN); both within the bound.
    g = torch.Generator().manual_seed(N + K + T)
    x, w, b = _rand(T, K, g=g), _rand(N, K, g=g, scale=K**-0.5), _rand(N, g=g)
    y = kernels.linear(x, w, b)
    assert y.dtype == BF and y.shape == (T, N)
    exact = F.linear(x.double(), w.double(), b.double())
    assert_within(y, exact, bf16_linear_error_bound(x, w, b, exact), f"bf16 linear T={T}")


@pytest.mark.parametrize("T", [1, 8, 9, 33, 130])
@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (576, 1536)])
def test_linear_on_a_prepacked_weight(T: int, N: int, K: int) -> None:
    # kernels.prepack: oneDNN's blocked copy of w; rows past the GEMV's go through it, fewer keep the
    # GEMV on w. Within the bf16 linear bound of the exact product either way, and of the plain path.
    g = torch.Generator().manual_seed(N + K + T)
    x, w, b = _rand(T, K, g=g), _rand(N, K, g=g, scale=K**-0.5), _rand(N, g=g)
    packed = kernels.prepack(w)
    if packed is None:
        pytest.skip("this torch has no oneDNN linear to prepack for (the plain path is the only one)")
    y = kernels.linear(x, w, b, packed)
    assert y.dtype == BF and y.shape == (T, N)
    exact = F.linear(x.double(), w.double(), b.double())
    bound = bf16_linear_error_bound(x, w, b, exact)
    assert_within(y, exact, bound, f"bf16 linear on a prepacked weight T={T}")
    assert_within(y.double(), kernels.linear(x, w, b).double(), 2 * bound, f"prepacked vs plain T={T}")
    if T <= BF16_GEMV_MAX_TOKENS:  # the GEMV's rows never touch the packed copy
        assert torch.equal(y, kernels.linear(x, w, b))
    y3 = kernels.linear(x.view(1, T, K), w, b, packed)  # leading dims kept
    assert y3.shape == (1, T, N) and torch.equal(y3[0], y)
    assert kernels.prepack(w.float()) is None  # fp32 weights keep MKL's path


def test_gemv_directly_on_every_path(ext) -> None:
    # The GEMV on each path: vdpbf16ps where the CPU has AVX512-BF16, its AVX-512 fallback, scalar.
    g = torch.Generator().manual_seed(7)
    x, w = _rand(7, 130, g=g), _rand(70, 130, g=g)
    exact = x.double() @ w.double().T
    bound = bf16_linear_error_bound(x, w, None, exact)
    for path in available_paths(ext):
        with on_path(ext, path):
            native = ext.gemv_bf16_native()
            assert native == (path == "avx512" and ext.cpu_has("avx512_bf16")), path
            assert_within(ext.gemv(x, w, None), exact, bound, f"gemv on {path}")
    assert BF16_GEMV_MAX_TOKENS >= 1


def _paged_case(g: torch.Generator, lens: list[int], H: int = 6, G: int = 2, D: int = 64, bs: int = 4):
    nb = max(-(-n // bs) for n in lens)
    tables = torch.randperm(len(lens) * nb, generator=g).view(len(lens), nb).to(torch.int32)
    S = len(lens) * nb * bs
    return tables, _rand(S, G, D, g=g), _rand(S, G, D, g=g), H, D, bs


@pytest.mark.parametrize("lens", [[1], [5, 130, 17], [300]])
def test_paged_decode_attention(isa: str, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(len(lens))
    tables, kc, vc, H, D, bs = _paged_case(g, lens)
    q = _rand(len(lens), H, D, g=g)
    cl = torch.tensor(lens, dtype=torch.int32)
    got = kernels.paged_decode_attention(q, kc, vc, tables, cl, bs, D**-0.5)
    want = kernels.paged_decode_attention_ref(q.double(), kc.double(), vc.double(), tables, cl, bs, D**-0.5)
    assert got.dtype == BF
    assert_within(got, want, bf16_attention_error_bound(want, _abs_max(vc), max(lens), D), "paged decode")


def test_varlen_paged_attention(isa: str) -> None:
    g = torch.Generator().manual_seed(5)
    lens = [9, 40, 3]  # context incl. the new tokens
    new = [4, 40, 1]
    tables, kc, vc, H, D, bs = _paged_case(g, lens)
    T = sum(new)
    q = _rand(T, H, D, g=g)
    cu = torch.tensor([0, 4, 44, 45], dtype=torch.int32)
    cl = torch.tensor(lens, dtype=torch.int32)
    got = kernels.varlen_paged_attention(q, kc, vc, tables, cu, cl, bs, D**-0.5)
    want = kernels.varlen_paged_attention_ref(q.double(), kc.double(), vc.double(), tables, cu, cl, bs, D**-0.5)
    assert got.dtype == BF
    assert_within(got, want, bf16_attention_error_bound(want, _abs_max(vc), max(lens), D), "varlen attention")


def test_mixed_dtypes_are_refused(ext) -> None:
    x = torch.randn(2, 8, dtype=BF)
    with pytest.raises(RuntimeError, match="weight must be"):
        ext.rms_norm(x, torch.ones(8), 1e-5, None)
    with pytest.raises(RuntimeError, match="w must be"):
        ext.gemv(x, torch.randn(4, 8), None)
