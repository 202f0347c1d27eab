"""q4_linear (C++, every ISA path) vs its reference, its batch invariance and the agreement of its
ISA paths, and the formats' round trips (int8_linear, the same kernel with int8 weights, has
tests/kernels/test_int8_linear_kernel.py).

The reference computes the kernel's own math (x quantized per block of 32, exact integer block dots,
float64 scaling), so the only difference is the kernel's fp32 rounding of the per-block sums,
bounded by tests/testkit/tolerance.py (a wrong row, block, scale, nibble or tail is off by
orders of magnitude more). The activation rounding itself, batch invariance and the ISA paths'
agreement are checked bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.quant_formats import (
    dequantize_int8,
    dequantize_q4,
    pack_q4,
    padded_k,
    quantize_int8,
    quantize_q4,
    unpack_q4,
)
from kernels.quant_linear import q4_tiles, quantize_activations_ref
from testkit.kernel_paths import assert_tiles_change_no_bit, available_paths, on_path
from testkit.tolerance import INT8_ACTIVATIONS, KERNEL_FP32, assert_within, q4_linear_error_bound

# SmolLM2's matrices plus K not a multiple of 32 or 64 (partial and whole padded blocks), N not a
# multiple of the 16-row tile, tiny cases.
SHAPES = [(960, 576), (576, 1536), (3072, 576), (37, 577), (100, 33), (17, 96), (5, 15), (1, 1), (33, 130)]
TOKENS = [1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 64]


def _problem(N: int, K: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K**0.5
    return w, torch.randn(N, generator=g), torch.randn(T, K, generator=g)


def _check(x, q, d, m, b=None) -> None:
    assert_within(kernels.q4_linear(x, q, d, m, b), kernels.q4_linear_ref(x, q, d, m, b),
                  q4_linear_error_bound(x, q, d, m, b), "q4_linear")


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", TOKENS)
def test_q4_matches_ref(dot_path: str, T: int, N: int, K: int) -> None:
    w, b, x = _problem(N, K, T, N * K + T + 1)
    q, d, m = quantize_q4(w)
    _check(x, q, d, m)
    _check(x, q, d, m, b)


@pytest.mark.parametrize("N,K,T", [(960, 576, 9), (37, 577, 33), (100, 33, 4), (3072, 576, 64)])
def test_isa_paths_agree_bitwise(ext, N: int, K: int, T: int) -> None:
    w, b, x = _problem(N, K, T, 9)
    q, d, m = quantize_q4(w)
    outs = {}
    for path in available_paths(ext):
        with on_path(ext, path):
            outs[path] = kernels.q4_linear(x, q, d, m, b)
    first = next(iter(outs.values()))
    for path, y in outs.items():
        assert torch.equal(y, first), f"{path} differs from {next(iter(outs))}"


@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (100, 33)])
def test_batch_invariant(dot_path: str, N: int, K: int) -> None:
    # Row 0 alone vs at every position of batches of 2..40 with random other rows: bit-identical.
    w, b, x = _problem(N, K, 40, 5)
    q, d, m = quantize_q4(w)
    alone = kernels.q4_linear(x[:1], q, d, m, b)[0]  # [N]
    g = torch.Generator().manual_seed(1)
    for T in range(2, 41):
        others = torch.randn(T, K, generator=g) * 3
        pos = int(torch.randint(0, T, (1,), generator=g))
        others[pos] = x[0]
        assert torch.equal(kernels.q4_linear(others, q, d, m, b)[pos], alone), f"T={T}, position {pos}"


@pytest.mark.parametrize("T,K", [(1, 576), (5, 577), (3, 15), (64, 1536)])
def test_activation_quantization_is_bitwise(isa: str, ext, T: int, K: int) -> None:
    x = torch.randn(T, K) * torch.rand(T, 1) * 10
    x[0, :5] = torch.tensor([0.5, -0.5, 2.5, 0.0, 1e-30])  # rounding ties and tiny values
    Kp = padded_k(K)
    q, sx = ext.quantize_activations(x, Kp)
    q_ref, sx_ref = quantize_activations_ref(x, Kp)
    assert torch.equal(q, q_ref) and torch.equal(sx, sx_ref)


def test_close_to_weight_only_product(ext) -> None:
    # The kernel vs x @ dequant(W)^T in fp32: they differ only by x's rounding to 8 bits per block
    # (relative error ~ 1/254 per element, averaging out over K): well under 2% of the output scale.
    w, _, x = _problem(512, 1536, 4, 7)
    q, d, m = quantize_q4(w)
    y, y_ref = kernels.q4_linear(x, q, d, m), F.linear(x, dequantize_q4(q, d, m, 1536))
    INT8_ACTIVATIONS.assert_close(y, y_ref)


def test_strided_and_leading_dims(ext) -> None:
    w, b, _ = _problem(40, 70, 1, 3)
    q, d, m = quantize_q4(w)
    x = torch.randn(3, 100)[:, 10:80]  # rows 100 floats apart
    _check(x, q, d, m, b)
    x3 = torch.randn(2, 3, 70)
    y3 = kernels.q4_linear(x3, q, d, m, b)
    assert y3.shape == (2, 3, 40)
    assert torch.equal(y3.view(6, 40), kernels.q4_linear(x3.view(6, 70), q, d, m, b))


def test_formats_round_trip() -> None:
    w = torch.randn(7, 100)
    q, s = quantize_int8(w)
    assert q.shape == (7, 128) and q.dtype == torch.int8 and (q[:, 100:] == 0).all()
    assert (dequantize_int8(q, s, 100) - w).abs().max() <= s.max() / 2 + 1e-7  # half a step
    packed, d, m = quantize_q4(w)
    assert packed.shape == (7, 64) and d.shape == (7, 4)
    codes = torch.randint(0, 16, (7, 128), dtype=torch.uint8)
    assert torch.equal(unpack_q4(pack_q4(codes)), codes)
    err = (dequantize_q4(packed, d, m, 100) - w).abs()  # per block: half a step of (max - min) / 15, + fp16
    step = (w.max() - w.min()) / 15
    assert err.max() <= step / 2 * 1.01 + 1e-3
    # Padding-only blocks: 100 columns -> blocks 0..3 hold 32, 32, 32, 4 real columns; none empty here,
    # but a K=15 row has one real block and three padded ones with d = m = 0.
    _, d15, m15 = quantize_q4(torch.randn(2, 15))
    assert (d15[:, 1:] == 0).all() and (m15[:, 1:] == 0).all()


def test_bad_input_raises(ext) -> None:
    packed, d, m = quantize_q4(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="mins"):
        ext.q4_linear(torch.randn(1, 64), packed, d, m.float(), None, 64)


def _tiles_ref(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """make_q4_tiles' layout (kernels/csrc/kernels.h) in torch: per 16 rows, the packed codes as 4-byte
    groups transposed so that group j of chunk c holds every row's bytes 4j..4j+3 of that chunk, then
    per block d and m (fp16 bits) of the 16 rows."""
    N, half = q.shape
    Kp, tiles = 2 * half, -(-N // 16)
    pad = tiles * 16 - N
    qp, dp, mp = (F.pad(t, (0, 0, 0, pad)) for t in (q, d, m))
    codes = qp.view(tiles, 16, Kp // 64, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, -1)  # [tile, chunk, j, row, 4]
    dm = torch.stack([dp, mp], 2).view(tiles, 16, Kp // 32, 2).permute(0, 2, 3, 1).reshape(tiles, -1)  # [tile, b, d|m, row]
    return torch.cat([codes, dm.contiguous().view(torch.uint8).view(tiles, -1)], 1)


@pytest.mark.parametrize("N,K", [(960, 576), (37, 577), (17, 96), (1, 1)])
def test_tiles_hold_the_weights_in_the_documented_order(ext, N: int, K: int) -> None:
    q, d, m = quantize_q4(_problem(N, K, 1, 3)[0])
    tiles = q4_tiles(q, d, m)
    assert tiles is not None and torch.equal(tiles, _tiles_ref(q, d, m))


@pytest.mark.parametrize("N,K", SHAPES)
def test_tiles_give_the_same_result_bit_for_bit(dot_path: str, N: int, K: int) -> None:
    """The weights in tile order (read by the VNNI path instead of repacking them per call; every
    other path ignores them) change no bit of any row, at every token count and thread count."""
    w, b, x = _problem(N, K, 64, N + K)
    q, d, m = quantize_q4(w)
    assert_tiles_change_no_bit(lambda x_, b_, t_: kernels.q4_linear(x_, q, d, m, b_, tiles=t_), x, b, q4_tiles(q, d, m),
                               TOKENS)


def test_tiles_of_another_weight_are_refused(ext) -> None:
    q, d, m = quantize_q4(torch.randn(40, 128))
    other = q4_tiles(*quantize_q4(torch.randn(40, 64)))
    with pytest.raises(RuntimeError, match=r"tiles must be .* uint8 \[3, 1280\]"):
        ext.q4_linear(torch.randn(1, 128), q, d, m, None, 128, other)


@pytest.mark.skipif(not kernels._triton.triton_available(), reason="the optional triton extra is not installed")
@pytest.mark.parametrize("T,N,K", [(1, 40, 130), (17, 33, 64), (5, 64, 200)])
def test_triton_kernel_vs_weight_only_ref(T: int, N: int, K: int) -> None:
    # The Triton kernel (GPU) does not quantize x: its reference is x @ dequant(W)^T. Run on CPU
    # tensors in Triton's interpreter (TRITON_INTERPRET=1 is set for the whole test session).
    from test_triton_kernels import tri

    ops = tri("quant_linear")
    w, b, x = _problem(N, K, T, 11)
    packed, d, m = quantize_q4(w)
    KERNEL_FP32.assert_close(ops.q4_linear_triton(x.view(1, T, K), packed, d, m, b).view(T, N),
                             F.linear(x, dequantize_q4(packed, d, m, K), b))
