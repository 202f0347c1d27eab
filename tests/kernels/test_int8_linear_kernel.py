"""int8_linear (weight-only int8, fp32 activations; C++ on every ISA path) vs int8_linear_ref, and
its batch invariance.

The reference is scales * (x . q) in float64; the kernel accumulates in fp32 (one chain per output
over K), so they differ by fp32 rounding only: rtol / atol 1e-5 on outputs of order 1 leaves a wide
margin over that (~1e-6) yet catches a wrong row, column, scale, bias or tail (errors ~1e-1).
Batch invariance is checked bit for bit: a token's output row must not depend on how many tokens
share the call or which, since speculative verification and continuous batching compare a
sequence's tokens computed in different batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.quant_formats import dequantize_int8, quantize_int8

from testkit.tolerance import KERNEL_FP32

# SmolLM2's matrices; K not a multiple of 16, 32 or 64 (masked last chunk, padded columns); N odd
# and not a multiple of the 16-row tile or of the row blocks (8 / 4 / 2); tiny cases.
SHAPES = [(960, 576), (576, 1536), (37, 577), (101, 33), (17, 96), (5, 15), (1, 1), (33, 130), (3, 200)]
TOKENS = [1, 2, 3, 7, 8, 9, 33]


def _problem(N: int, K: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_int8(torch.randn(N, K, generator=g) / K**0.5)
    return q, s, torch.randn(N, generator=g), torch.randn(T, K, generator=g)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", TOKENS)
def test_matches_ref(isa: str, T: int, N: int, K: int) -> None:
    q, s, b, x = _problem(N, K, T, N * K + T)
    KERNEL_FP32.assert_close(kernels.int8_linear(x, q, s), kernels.int8_linear_ref(x, q, s))
    KERNEL_FP32.assert_close(kernels.int8_linear(x, q, s, b), kernels.int8_linear_ref(x, q, s, b))


@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (101, 33)])
def test_batch_invariant(isa: str, N: int, K: int) -> None:
    # Row 0 alone vs at every position of batches of 2..40 (crossing the 8-token passes and, past 8
    # tokens, the widened-tile path), with random other rows: bit-identical.
    q, s, b, x = _problem(N, K, 40, 5)
    alone = kernels.int8_linear(x[:1], q, s, b)[0]  # [N]
    g = torch.Generator().manual_seed(1)
    for T in range(2, 41):
        others = torch.randn(T, K, generator=g) * 3
        pos = int(torch.randint(0, T, (1,), generator=g))
        others[pos] = x[0]
        y = kernels.int8_linear(others, q, s, b)  # [T, N]
        assert torch.equal(y[pos], alone), f"T={T}: row at position {pos} differs from the row alone"


def test_batch_invariant_across_token_blocks(ext) -> None:
    # K = 1536: x is walked in blocks of 40 tokens (<= 256 KB), so a 130-token batch takes four.
    q, s, b, x = _problem(70, 1536, 130, 6)
    y = kernels.int8_linear(x, q, s, b)  # [130, N]
    for pos in (0, 39, 40, 41, 129):
        assert torch.equal(y[pos], kernels.int8_linear(x[pos : pos + 1], q, s, b)[0]), pos


def test_threads_do_not_change_results(ext) -> None:
    q, s, b, x = _problem(3072, 576, 12, 2)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.int8_linear(x, q, s, b)
        torch.set_num_threads(2)
        two = kernels.int8_linear(x, q, s, b)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_lm_head_shape(ext) -> None:
    q, s, _, x = _problem(49152, 576, 1, 0)
    KERNEL_FP32.assert_close(kernels.int8_linear(x, q, s), kernels.int8_linear_ref(x, q, s))


def test_equals_fp32_linear_on_dequantized_weight(ext) -> None:
    # Weight-only: the kernel is F.linear on the de-quantized weight up to fp32 rounding (the W8A8
    # kernel it replaced was ~1e-2 away, from rounding x to 8 bits).
    q, s, b, x = _problem(512, 1536, 4, 7)
    KERNEL_FP32.assert_close(kernels.int8_linear(x, q, s, b), F.linear(x, dequantize_int8(q, s, 1536), b))


def test_strided_and_leading_dims(ext) -> None:
    q, s, b, _ = _problem(40, 70, 1, 3)
    x = torch.randn(3, 100)[:, 10:80]  # rows 100 floats apart
    KERNEL_FP32.assert_close(kernels.int8_linear(x, q, s, b), kernels.int8_linear_ref(x, q, s, b))
    x3 = torch.randn(2, 3, 70)
    y3 = kernels.int8_linear(x3, q, s, b)
    assert y3.shape == (2, 3, 40)
    KERNEL_FP32.assert_close(y3.view(6, 40), kernels.int8_linear_ref(x3.view(6, 70), q, s, b))
    assert kernels.int8_linear(torch.randn(0, 70), q, s, b).shape == (0, 40)


def test_reference_path_when_kernels_disabled(ext) -> None:
    q, s, b, x = _problem(33, 130, 3, 4)
    old = kernels.set_cpu_kernels_enabled(False)
    try:
        y = kernels.int8_linear(x.view(1, 3, 130), q, s, b)
    finally:
        kernels.set_cpu_kernels_enabled(old)
    assert torch.equal(y.view(3, 33), kernels.int8_linear_ref(x, q, s, b))


def test_bad_input_raises(ext) -> None:
    q, s = quantize_int8(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="K = 65"):
        ext.int8_linear(torch.randn(1, 65), q, s, None, 65)
    with pytest.raises(RuntimeError, match="scales"):
        ext.int8_linear(torch.randn(1, 64), q, s[:3], None, 64)
    with pytest.raises(RuntimeError, match="qweight"):
        ext.int8_linear(torch.randn(1, 64), q.float(), s, None, 64)
    with pytest.raises(RuntimeError, match="bias"):
        ext.int8_linear(torch.randn(1, 64), q, s, torch.zeros(5), 64)
    with pytest.raises(RuntimeError, match="float32"):
        ext.int8_linear(torch.randn(1, 64).double(), q, s, None, 64)


@pytest.mark.skipif(not kernels._triton.triton_available(), reason="the optional triton extra is not installed")
@pytest.mark.parametrize("T,N,K", [(1, 40, 130), (17, 33, 64), (5, 64, 200)])
def test_triton_kernel_vs_weight_only_ref(T: int, N: int, K: int) -> None:
    # The Triton kernel (GPU), run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 is set
    # for the whole test session).
    from test_triton_kernels import tri

    q, s, b, x = _problem(N, K, T, 11)
    y = tri("int8_linear").int8_linear_triton(x.view(1, T, K), q, s, b).view(T, N)
    KERNEL_FP32.assert_close(y, F.linear(x, dequantize_int8(q, s, K), b))
