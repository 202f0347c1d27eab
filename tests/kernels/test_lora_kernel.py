"""Batched LoRA (kernels/lora.py): the CPU path (on every ISA path of the C++ grouped GEMM, and
with the CPU kernels off) and the Triton kernel (in the interpreter) vs ``lora_ref``.

Cases: tokens of several slots interleaved with base tokens (-1), slots with no tokens, a batch of
only base tokens, a single token, more tokens of one slot than the GEMV threshold, K and N that are
not multiples of the SIMD width, ranks zero-padded; steps of up to DENSE_MAX_TOKENS tokens (the
dense form, with B contiguous and as the transposed view the slots hold) and more (the grouped GEMMs). Tolerance: fp32 dot products of length K then R
summed in another order (KERNEL_FP32); bf16 outputs: the update rounded once into bf16.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.grouped_gemm import GEMV_MAX_ROWS
from kernels.lora import DENSE_MAX_TOKENS, lora, lora_groups, lora_parts, lora_ref

from testkit.tolerance import KERNEL_FP32, bf16_ulps

CASES = [
    # (idx, S, R, K, N)
    ([0, -1, 1, 0, 2, -1, 1], 4, 8, 64, 96),
    ([-1, -1, -1], 3, 4, 16, 16),
    ([2], 3, 16, 33, 17),
    ([1] * (GEMV_MAX_ROWS + 3) + [0, -1] * 5, 2, 8, 40, 72),
    ([3, 3, 0, -1, 3], 5, 12, 65, 129),
    ([i % 3 - 1 for i in range(3 * DENSE_MAX_TOKENS)], 2, 8, 48, 40),  # > DENSE_MAX_TOKENS: the grouped GEMMs
    ([4, -1, 0, 4, 2] * 9, 6, 8, 40, 24),  # > DENSE_MAX_TOKENS, B a transposed view
]


def make(idx: list[int], s: int, r: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = len(idx)
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    a = torch.randn(s, r, k, generator=g) / k**0.5
    b = torch.randn(s, n, r, generator=g) / r**0.5
    a[:, r // 2 :] = 0  # the upper half of the rank zero-padded, as in the slots
    b[:, :, r // 2 :] = 0
    scales = torch.rand(s, generator=g) + 0.5
    return y, x, a, b, scales, torch.tensor(idx)


def test_ref_worked_example() -> None:
    x = torch.tensor([[1.0], [2.0], [3.0]])
    a = torch.tensor([[[2.0]], [[3.0]]])
    b = torch.tensor([[[10.0]], [[1.0]]])
    y = lora_ref(torch.zeros(3, 1), x, a, b, torch.tensor([0.5, 1.0]), torch.tensor([0, -1, 1]))
    assert y.tolist() == [[10.0], [0.0], [9.0]]


@pytest.mark.parametrize("idx,s,r,k,n", CASES)
def test_cpu_path_matches_ref(isa: str, idx, s, r, k, n) -> None:
    y, x, a, b, scales, ix = make(idx, s, r, k, n)
    want = lora_ref(y.clone(), x, a, b, scales, ix)
    got = lora(y.clone(), x, a, b, scales, ix)
    KERNEL_FP32.assert_close(got, want)
    base = ix < 0
    assert torch.equal(got[base], y[base])  # base tokens untouched, bit for bit


@pytest.mark.parametrize("idx,s,r,k,n", CASES[:2])
def test_cpu_kernels_off_matches_ref(idx, s, r, k, n) -> None:
    y, x, a, b, scales, ix = make(idx, s, r, k, n, seed=3)
    old = kernels.set_cpu_kernels_enabled(False)
    try:
        got = lora(y.clone(), x, a, b, scales, ix)
    finally:
        kernels.set_cpu_kernels_enabled(old)
    KERNEL_FP32.assert_close(got, lora_ref(y.clone(), x, a, b, scales, ix))


def test_bf16_activations_update_in_fp32(ext) -> None:
    y, x, a, b, scales, ix = make(*CASES[0], seed=4)
    got = lora(y.bfloat16(), x.bfloat16(), a, b, scales, ix)
    want = lora_ref(y.bfloat16().float(), x.bfloat16().float(), a, b, scales, ix).bfloat16()
    assert got.dtype is torch.bfloat16
    bf16_ulps(1).assert_close(got, want)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[-1]])
def test_b_as_a_transposed_view(ext, case) -> None:
    """The slots hold B transposed ([S, R, N]) and pass ``bt.transpose(1, 2)``: same result."""
    y, x, a, b, scales, ix = make(*case, seed=5)
    view = b.transpose(1, 2).contiguous().transpose(1, 2)
    KERNEL_FP32.assert_close(lora(y.clone(), x, a, view, scales, ix), lora_ref(y.clone(), x, a, b, scales, ix))


@pytest.mark.parametrize("case", [CASES[0], CASES[-2]])
def test_bf16_slots(ext, case) -> None:
    """A bf16 model's slots are bf16: the dense form computes in bf16 (h and the update rounded to
    bf16 once each, then added to bf16 y), the grouped form widens them to fp32."""
    y, x, a, b, scales, ix = make(*case, seed=6)
    a16, b16 = a.bfloat16(), b.bfloat16()
    got = lora(y.bfloat16(), x.bfloat16(), a16, b16, scales, ix)
    want = lora_ref(y.bfloat16().float(), x.bfloat16().float(), a16.float(), b16.float(), scales, ix).bfloat16()
    bf16_ulps(4).assert_close(got, want)


def test_groups_sort_tokens_by_slot() -> None:
    g = lora_groups(torch.tensor([2, -1, 0, 2, 0]), 3)
    assert g.rows.tolist() == [2, 4, 0, 3] and g.offsets.tolist() == [0, 2, 2, 4]
    assert g.row_slots.tolist() == [0, 0, 2, 2] and g.num_used == 3
    assert g.onehot.tolist() == [[0, 0, 1], [0, 0, 0], [1, 0, 0], [0, 0, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="adapter index 3 >= 3 slots"):
        lora_groups(torch.tensor([3]), 3)


def test_shape_errors_name_the_shapes() -> None:
    y, x, a, b, scales, ix = make(*CASES[0])
    with pytest.raises(ValueError, match="shapes disagree"):
        lora(y, x, a, b[:, :5], scales, ix)


@pytest.mark.skipif(not kernels._triton.triton_available(), reason="the optional triton extra is not installed")
@pytest.mark.parametrize("idx,s,r,k,n", CASES)
def test_triton_kernel_matches_ref(idx, s, r, k, n) -> None:
    import importlib
    import os
    import sys

    assert os.environ.get("TRITON_INTERPRET") == "1"  # set session-wide by tests/conftest.py
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module("kernels.triton_ops.lora")
    if not isinstance(mod._lora_kernel, InterpretedFunction):  # imported earlier without the interpreter
        mod = importlib.reload(sys.modules["kernels.triton_ops.lora"])
    y, x, a, b, scales, ix = make(idx, s, r, k, n, seed=1)
    want = lora_ref(y.clone(), x, a, b, scales, ix)
    KERNEL_FP32.assert_close(mod.lora_triton(y.clone(), x, a, b, scales, ix), want)


@pytest.mark.skipif(not kernels._triton.triton_available(), reason="the optional triton extra is not installed")
def test_triton_kernel_on_a_column_slice_leaves_the_rest() -> None:
    """A fused projection's part: y is a column slice of a wider output (rows strided)."""
    import importlib
    import sys

    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module("kernels.triton_ops.lora")
    if not isinstance(mod._lora_kernel, InterpretedFunction):
        mod = importlib.reload(sys.modules["kernels.triton_ops.lora"])
    y, x, a, b, scales, ix = make(*CASES[0], seed=2)
    wide = torch.randn(y.shape[0], y.shape[1] + 20)
    got = wide.clone()
    mod.lora_triton(got[:, 10:10 + y.shape[1]], x, a, b, scales, ix)
    want = lora_ref(wide[:, 10:10 + y.shape[1]].clone(), x, a, b, scales, ix)
    KERNEL_FP32.assert_close(got[:, 10:10 + y.shape[1]], want)
    assert torch.equal(got[:, :10], wide[:, :10]) and torch.equal(got[:, 10 + y.shape[1]:], wide[:, 10 + y.shape[1]:])


# lora_parts: one call per projection, every targeted part into its columns of y (the per-token C++
# kernel at decode sizes on CPU; the loop over ``lora`` elsewhere).
PART_CASES = [
    # (idx, S, R, K, part widths with a gap between parts, N)
    ([0, -1, 1, 0, 2, -1, 1], 4, 8, 64, [(0, 40), (56, 24)], 96),
    ([2], 3, 16, 33, [(1, 17)], 20),
    ([3, 3, 0, -1, 3], 5, 12, 65, [(0, 48), (48, 16), (64, 16)], 80),
    ([i % 5 - 1 for i in range(DENSE_MAX_TOKENS)], 4, 8, 40, [(0, 24), (24, 24)], 48),
    ([-1, -1], 2, 8, 16, [(0, 16)], 16),
]


def make_parts(idx, s, r, k, widths, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(idx), k, generator=g).to(dtype)
    y = torch.randn(len(idx), n, generator=g).to(dtype)
    parts = []
    for start, w in widths:
        a = torch.randn(s, r, k, generator=g) / k**0.5
        bt = torch.randn(s, r, w, generator=g) / r**0.5
        a[:, r // 2:] = 0  # zero-padded rank, as in the slots
        bt[:, r // 2:] = 0
        parts.append((a.to(dtype), bt.to(dtype), start))
    return y, x, parts, torch.rand(s, generator=g) + 0.5, torch.tensor(idx)


def parts_ref(y, x, parts, scales, idx):
    y = y.float()
    for a, bt, start in parts:
        lora_ref(y.narrow(1, start, bt.shape[2]), x.float(), a.float(), bt.float().transpose(1, 2), scales, idx)
    return y


@pytest.mark.parametrize("case", PART_CASES)
def test_parts_match_the_per_part_reference(isa: str, case) -> None:
    y, x, parts, scales, ix = make_parts(*case)
    got = lora_parts(y.clone(), x, parts, scales, lora_groups(ix, scales.shape[0]))
    KERNEL_FP32.assert_close(got, parts_ref(y, x, parts, scales, ix))
    covered = torch.zeros(y.shape[1], dtype=torch.bool)
    for _, bt, start in parts:
        covered[start:start + bt.shape[2]] = True
    base = ix < 0
    assert torch.equal(got[base], y[base]) and torch.equal(got[:, ~covered], y[:, ~covered])  # untouched, bit for bit


@pytest.mark.parametrize("case", PART_CASES[:4])
def test_parts_bf16(isa: str, case) -> None:
    """bf16 x, y and slots: the update accumulates in fp32 and is added to y once (one rounding)."""
    y, x, parts, scales, ix = make_parts(*case, seed=1, dtype=torch.bfloat16)
    got = lora_parts(y.clone(), x, parts, scales, lora_groups(ix, scales.shape[0]))
    assert got.dtype is torch.bfloat16
    bf16_ulps(1).assert_close(got, parts_ref(y, x, parts, scales, ix).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_rows_are_batch_invariant(ext, dtype) -> None:
    """A token's update depends on that token alone: the same bits alone or in any batch (what keeps
    speculative verification, which runs a request's rows beside other batches, exact under LoRA)."""
    y, x, parts, scales, ix = make_parts(*PART_CASES[3], seed=2, dtype=dtype)
    batch = lora_parts(y.clone(), x, parts, scales, lora_groups(ix, scales.shape[0]))
    for t in range(0, len(ix), 5):
        one = lora_parts(y[t:t + 1].clone(), x[t:t + 1], parts, scales, lora_groups(ix[t:t + 1], scales.shape[0]))
        assert torch.equal(one[0], batch[t])


def test_parts_with_the_kernels_off_match(ext) -> None:
    y, x, parts, scales, ix = make_parts(*PART_CASES[0], seed=3)
    old = kernels.set_cpu_kernels_enabled(False)
    try:
        got = lora_parts(y.clone(), x, parts, scales, lora_groups(ix, scales.shape[0]))
    finally:
        kernels.set_cpu_kernels_enabled(old)
    KERNEL_FP32.assert_close(got, parts_ref(y, x, parts, scales, ix))


def test_parts_kernel_refuses_bad_shapes(ext) -> None:
    y, x, parts, scales, ix = make_parts(*PART_CASES[0])
    a, bt, _ = parts[0]
    with pytest.raises(RuntimeError, match="outside y's 96"):
        ext.lora_rows(y, x, [a], [bt], [90], scales, ix)
    with pytest.raises(RuntimeError, match="must be \\[S, R, K\\]"):
        ext.lora_rows(y, x, [a[:, :, :10]], [bt], [0], scales, ix)
    with pytest.raises(RuntimeError, match="adapter index 7 >= 4 slots"):
        ext.lora_rows(y, x, [a], [bt], [0], scales, torch.tensor([7] + [0] * 6))
