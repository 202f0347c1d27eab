"""paged_decode_attention C++ kernel vs paged_decode_attention_ref (gather + softmax in torch).

Tolerance: outputs are convex combinations of V rows (|v| ~ 1). The kernel's scores differ from the
reference's by a few ulp (different dot-product order), its exp by ~1-2 ulp, and long contexts are
split into ranges merged with rescaling: all ~1e-7 relative. atol/rtol 1e-5 leaves a wide margin
while any wrong slot, head mapping or mask changes outputs by ~0.1.
"""

from __future__ import annotations

import pytest
import torch

import kernels

from testkit.tolerance import KERNEL_FP32


def _case(B: int, H: int, G: int, D: int, block_size: int, lens: list[int], index_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in lens)) + 1  # one spare column
    num_blocks = B * max_blocks + 3
    S = num_blocks * block_size
    k_cache = torch.randn(S, G, D, generator=g)
    v_cache = torch.randn(S, G, D, generator=g)
    # Each sequence gets distinct, shuffled blocks; unused columns hold garbage-but-valid ids.
    block_tables = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).to(index_dtype)
    q = torch.randn(B, H, D, generator=g)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=index_dtype)


CASES = [
    # B, H, G, D, block_size, context lengths
    (1, 9, 3, 64, 16, [1]),
    (1, 9, 3, 64, 16, [17]),
    (1, 9, 3, 64, 16, [100]),
    (1, 9, 3, 64, 16, [1000]),  # long: split across threads, partial softmaxes merged
    (5, 9, 3, 64, 16, [1, 15, 16, 33, 250]),
    (5, 9, 3, 64, 16, [700, 1, 0, 129, 64]),  # a zero-length sequence gets zeros
    (2, 4, 4, 80, 5, [11, 23]),  # MHA, D not a multiple of 16, odd block size
    (3, 8, 1, 24, 7, [50, 3, 400]),  # MQA, tiny D (generic, untiled AVX-512 path)
    (1, 14, 2, 64, 16, [300]),  # 7 heads per kv head: register tiles of 3 + 4 heads (Qwen2.5-0.5B)
    (2, 8, 2, 128, 16, [40, 200]),  # D = 128: tiles of 2 heads (Llama-style)
]


@pytest.mark.parametrize("B,H,G,D,block_size,lens", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_ref(isa: str, B, H, G, D, block_size, lens, index_dtype) -> None:
    q, kc, vc, bt, cl = _case(B, H, G, D, block_size, lens, index_dtype, seed=sum(lens) + B * D)
    scale = D**-0.5
    out = kernels.paged_decode_attention(q, kc, vc, bt, cl, block_size, scale)
    ref = kernels.paged_decode_attention_ref(q, kc, vc, bt, cl, block_size, scale)
    KERNEL_FP32.assert_close(out, ref)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


def test_ref_matches_sdpa() -> None:
    # The reference itself against SDPA on the gathered, contiguous K/V of one sequence.
    q, kc, vc, bt, cl = _case(1, 9, 3, 64, 16, [37], torch.int64, seed=1)
    t = torch.arange(37)
    slots = bt[0][t // 16] * 16 + t % 16
    k, v = kc[slots].transpose(0, 1).unsqueeze(0), vc[slots].transpose(0, 1).unsqueeze(0)  # [1, G, L, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)
    ref = kernels.paged_decode_attention_ref(q, kc, vc, bt, cl, 16, 64**-0.5)
    KERNEL_FP32.assert_close(ref, sdpa)


def test_large_scores_are_stable(ext) -> None:
    q, kc, vc, bt, cl = _case(1, 9, 3, 64, 16, [300], torch.int32, seed=2)
    out = kernels.paged_decode_attention(q * 100, kc, vc, bt, cl, 16, 1.0)  # scores ~ +-800
    ref = kernels.paged_decode_attention_ref(q * 100, kc, vc, bt, cl, 16, 1.0)
    assert torch.isfinite(out).all()
    KERNEL_FP32.assert_close(out, ref)


def test_strided_q_and_out_param(ext) -> None:
    B, H, G, D = 2, 9, 3, 64
    q, kc, vc, bt, cl = _case(B, H, G, D, 16, [40, 5], torch.int32, seed=3)
    qkv = torch.randn(B, (H + 2 * G) * D)
    qkv[:, : H * D] = q.reshape(B, H * D)
    q_view = qkv[:, : H * D].view(B, H, D)  # rows (H + 2G) * D floats apart, as in the model
    out_buf = torch.full((B + 1, H, D), float("nan"))
    res = kernels.paged_decode_attention(q_view, kc, vc, bt, cl, 16, D**-0.5, out=out_buf[1:])
    assert res.data_ptr() == out_buf[1:].data_ptr()
    KERNEL_FP32.assert_close(out_buf[1:], kernels.paged_decode_attention_ref(q, kc, vc, bt, cl, 16, D**-0.5))
    assert torch.isnan(out_buf[0]).all()


def test_bad_block_tables_raise(ext) -> None:
    q, kc, vc, bt, cl = _case(1, 9, 3, 64, 16, [40], torch.int32, seed=4)
    with pytest.raises(RuntimeError, match="columns"):
        ext.paged_decode_attention(q, kc, vc, bt[:, :2], cl, 16, 0.125, None)  # 40 tokens need 3 blocks
    bad = bt.clone()
    bad[0, 1] = kc.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.paged_decode_attention(q, kc, vc, bad, cl, 16, 0.125, None)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        ext.paged_decode_attention(torch.randn(1, 8, 64), kc, vc, bt, cl, 16, 0.125, None)


@pytest.mark.parametrize("lens", [[1, 0, 300], [1000]])
def test_lse_matches_ref(isa: str, lens) -> None:
    q, kc, vc, bt, cl = _case(len(lens), 9, 3, 64, 16, lens, torch.int32, seed=5)
    out, lse = kernels.paged_decode_attention(q, kc, vc, bt, cl, 16, 0.125, return_lse=True)
    ref, ref_lse = kernels.paged_decode_attention_ref(q, kc, vc, bt, cl, 16, 0.125, return_lse=True)
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)  # -inf where the context is empty
    assert lse.dtype == torch.float32 and lse.shape == (len(lens), 9)


@pytest.mark.parametrize("lens", [[1000, 5, 300, 129], [64, 2000, 17]])
def test_a_sequence_is_bit_identical_alone_batched_and_on_any_thread_count(isa: str, lens: list[int]) -> None:
    """Work is split into fixed ranges per sequence, never by the batch or the thread count: a
    sequence's output alone equals its row in a batch, on 1 or 2 threads (speculative
    verification and continuous batching rely on this for greedy equality)."""
    q, k_cache, v_cache, tables, ctx = _case(len(lens), 9, 3, 64, 16, lens, torch.int32, seed=sum(lens))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = kernels.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 16, 0.125)
        for b in range(len(lens)):
            for n in (1, 2):
                torch.set_num_threads(n)
                alone = kernels.paged_decode_attention(q[b : b + 1], k_cache, v_cache, tables[b : b + 1],
                                                       ctx[b : b + 1], 16, 0.125)
                assert torch.equal(alone[0], batched[b]), (b, n)
    finally:
        torch.set_num_threads(threads)
