"""int8_linear (int8 weights, activations quantized per block of 32; C++ on every ISA path) vs
int8_linear_ref, its batch invariance and the agreement of its ISA paths.

The reference quantizes x exactly as the kernel does and computes the integer block dots exactly
in float64, so the two differ by the kernel's fp32 rounding of the per-block sums only:
tests/testkit/tolerance.py bounds that from the kernel's float sequence (a wrong row, block,
scale, bias or tail is off by orders of magnitude more). Batch invariance and the ISA paths'
agreement are checked bit for bit: a token's output row must not depend on how many tokens share
the call (speculative verification and continuous batching compare a sequence's tokens computed
in different batches), and every path runs the same float sequence per element.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.int8_linear import int8_tiles
from kernels.quant_formats import dequantize_int8, quantize_int8
from testkit.kernel_paths import assert_tiles_change_no_bit, available_paths, on_path
from testkit.tolerance import INT8_ACTIVATIONS, KERNEL_FP32, assert_within, int8_linear_error_bound

# SmolLM2's matrices; K not a multiple of 16, 32 or 64 (masked last block, padded columns); N odd
# and not a multiple of the 16-row tile or of a tile pair; tiny cases.
SHAPES = [(960, 576), (576, 1536), (37, 577), (101, 33), (17, 96), (5, 15), (1, 1), (33, 130), (3, 200)]
TOKENS = [1, 2, 3, 4, 5, 7, 8, 9, 33, 64]


def _problem(N: int, K: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_int8(torch.randn(N, K, generator=g) / K**0.5)
    return q, s, torch.randn(N, generator=g), torch.randn(T, K, generator=g)


def _check(x, q, s, b=None) -> None:
    assert_within(kernels.int8_linear(x, q, s, b), kernels.int8_linear_ref(x, q, s, b),
                  int8_linear_error_bound(x, q, s, b), "int8_linear")


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", TOKENS)
def test_matches_ref(dot_path: str, T: int, N: int, K: int) -> None:
    q, s, b, x = _problem(N, K, T, N * K + T)
    _check(x, q, s)
    _check(x, q, s, b)


@pytest.mark.parametrize("N,K,T", [(960, 576, 9), (37, 577, 33), (101, 33, 4), (3072, 576, 64)])
def test_isa_paths_agree_bitwise(ext, N: int, K: int, T: int) -> None:
    q, s, b, x = _problem(N, K, T, 9)
    outs = {}
    for path in available_paths(ext):
        with on_path(ext, path):
            outs[path] = kernels.int8_linear(x, q, s, b)
    first = next(iter(outs.values()))
    for path, y in outs.items():
        assert torch.equal(y, first), f"{path} differs from {next(iter(outs))}"


@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (101, 33)])
def test_batch_invariant(dot_path: str, N: int, K: int) -> None:
    # Row 0 alone vs at every position of batches of 2..40 (crossing the 4-token passes and the
    # tile pairs), with random other rows: bit-identical.
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
    # K = 1536: x is walked in blocks of <= 256 KB of int8 codes (168 tokens), so 400 tokens take three.
    q, s, b, x = _problem(70, 1536, 400, 6)
    y = kernels.int8_linear(x, q, s, b)  # [400, N]
    for pos in (0, 167, 168, 169, 399):
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
    q, s, _, x = _problem(49152, 576, 3, 0)
    _check(x, q, s)


def test_close_to_weight_only_product(ext) -> None:
    # The kernel vs x @ dequant(W)^T in fp32: they differ by x's rounding to 8 bits per block of 32
    # (relative error <= 1/254 per element, averaging out over K): well under 2% of the output scale.
    q, s, b, x = _problem(512, 1536, 4, 7)
    y, y_ref = kernels.int8_linear(x, q, s, b), F.linear(x, dequantize_int8(q, s, 1536), b)
    INT8_ACTIVATIONS.assert_close(y, y_ref)


def test_strided_and_leading_dims(ext) -> None:
    q, s, b, _ = _problem(40, 70, 1, 3)
    x = torch.randn(3, 100)[:, 10:80]  # rows 100 floats apart
    _check(x, q, s, b)
    x3 = torch.randn(2, 3, 70)
    y3 = kernels.int8_linear(x3, q, s, b)
    assert y3.shape == (2, 3, 40)
    assert torch.equal(y3.view(6, 40), kernels.int8_linear(x3.view(6, 70), q, s, b))
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
    # The Triton kernel (GPU) does not quantize x: its reference is x @ dequant(W)^T. Run on CPU
    # tensors in Triton's interpreter (TRITON_INTERPRET=1 is set for the whole test session).
    from test_triton_kernels import tri

    q, s, b, x = _problem(N, K, T, 11)
    y = tri("int8_linear").int8_linear_triton(x.view(1, T, K), q, s, b).view(T, N)
    KERNEL_FP32.assert_close(y, F.linear(x, dequantize_int8(q, s, K), b))


def _tiles_ref(q: torch.Tensor) -> torch.Tensor:
    """make_int8_tiles' layout (kernels/csrc/kernels.h) in torch: per 16 rows (the last padded with
    code 0), per group s of 4 codes, each row's codes 4s..4s+3, biased by 128."""
    N, Kp = q.shape
    tiles = -(-N // 16)
    biased = (F.pad(q, (0, 0, 0, tiles * 16 - N)).to(torch.int16) + 128).to(torch.uint8)
    return biased.view(tiles, 16, Kp // 4, 4).permute(0, 2, 1, 3).reshape(tiles, -1)


@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (17, 96), (1, 1)])
def test_tiles_hold_the_weights_in_the_documented_order(ext, N: int, K: int) -> None:
    q, _ = quantize_int8(torch.randn(N, K))
    tiles = int8_tiles(q)
    assert tiles is not None and torch.equal(tiles, _tiles_ref(q))


@pytest.mark.parametrize("N,K", SHAPES)
def test_tiles_give_the_same_result_bit_for_bit(dot_path: str, N: int, K: int) -> None:
    """The weights in tile order (read by the VNNI path instead of repacking them per call; every
    other path ignores them) change no bit of any row, at every token count and thread count."""
    g = torch.Generator().manual_seed(N + K)
    w, b, x = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(64, K, generator=g)
    q, s = quantize_int8(w)
    assert_tiles_change_no_bit(lambda x_, b_, t_: kernels.int8_linear(x_, q, s, b_, tiles=t_), x, b, int8_tiles(q), TOKENS)


def test_tiles_of_another_weight_are_refused(ext) -> None:
    q, s = quantize_int8(torch.randn(40, 128))
    with pytest.raises(RuntimeError, match=r"tiles must be .* uint8 \[3, 2048\]"):
        ext.int8_linear(torch.randn(1, 128), q, s, None, 128, int8_tiles(quantize_int8(torch.randn(40, 64))[0]))
