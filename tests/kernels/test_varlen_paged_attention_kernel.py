"""varlen_paged_attention C++ kernel vs varlen_paged_attention_ref (gather + masked softmax in torch).

Tolerance as for paged decode attention: outputs are convex combinations of V rows (|v| ~ 1), the
kernel's dot products, exps and chunked online softmax differ from the reference by ~1e-7 relative;
atol/rtol 1e-5 leaves a wide margin while a wrong slot, mask or head mapping changes outputs by ~0.1.
The lse is log of a sum of >= 1 terms of size ~1: the same absolute tolerance applies.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.varlen_paged_attention import tree_visibility

from testkit.tolerance import KERNEL_FP32


def make_case(H, G, D, block_size, ns, ctxs, index_dtype=torch.int32, seed=0, tree=False):
    """Random cache, shuffled block tables (one spare column), q rows for the new tokens; with
    tree=True, random valid parents per sequence."""
    g = torch.Generator().manual_seed(seed)
    B = len(ns)
    max_blocks = max(1, max((c + block_size - 1) // block_size for c in ctxs)) + 1
    num_blocks = B * max_blocks + 3
    k_cache = torch.randn(num_blocks * block_size, G, D, generator=g)
    v_cache = torch.randn(num_blocks * block_size, G, D, generator=g)
    block_tables = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).to(index_dtype)
    cu = torch.tensor([0, *torch.tensor(ns, dtype=torch.long).cumsum(0).tolist()], dtype=index_dtype)
    q = torch.randn(sum(ns), H, D, generator=g)
    parents = None
    if tree:
        par: list[int] = []
        for n in ns:
            par += [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
        parents = torch.tensor(par, dtype=index_dtype)
    return q, k_cache, v_cache, block_tables, cu, torch.tensor(ctxs, dtype=index_dtype), block_size, D**-0.5, parents


CASES = [
    # H, G, D, block_size, new tokens per sequence, context lengths (including the new tokens)
    (9, 3, 64, 16, [1], [1]),  # a single token, nothing cached
    (9, 3, 64, 16, [5], [5]),  # fresh prefill inside one partial block
    (9, 3, 64, 16, [40], [40]),  # fresh prefill over 3 blocks, the last partial
    (9, 3, 64, 16, [16, 17], [16, 300]),  # second: 17 new tokens after a 283-token prefix
    (9, 3, 64, 16, [0, 3, 0, 7], [0, 20, 5, 7]),  # empty sequences (no rows), one with cache but no new tokens
    (9, 3, 64, 16, [5], [2000]),  # speculative verify at long context: key range split across threads
    (9, 3, 64, 16, [200], [1500]),  # a long chunk: many query blocks
    (4, 4, 80, 5, [7, 11], [30, 11]),  # MHA, D not a multiple of 16, odd block size
    (8, 1, 24, 7, [9, 2], [50, 400]),  # MQA, tiny D (untiled AVX-512 path)
    (14, 2, 64, 16, [19], [100]),  # 7 heads per kv head (Qwen2.5-0.5B)
    (8, 2, 128, 32, [33], [90]),  # D = 128
]


@pytest.mark.parametrize("H,G,D,block_size,ns,ctxs", CASES)
@pytest.mark.parametrize("tree", [False, True])
def test_matches_ref(isa: str, H, G, D, block_size, ns, ctxs, tree) -> None:
    args = make_case(H, G, D, block_size, ns, ctxs, seed=sum(ctxs) + D, tree=tree)
    out, lse = kernels.varlen_paged_attention(*args[:8], tree_parents=args[8], return_lse=True)
    ref, ref_lse = kernels.varlen_paged_attention_ref(*args[:8], tree_parents=args[8], return_lse=True)
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtypes(ext, index_dtype) -> None:
    args = make_case(9, 3, 64, 16, [3, 12], [40, 12], index_dtype=index_dtype, seed=5, tree=True)
    out = kernels.varlen_paged_attention(*args[:8], tree_parents=args[8])
    KERNEL_FP32.assert_close(out, kernels.varlen_paged_attention_ref(*args[:8], tree_parents=args[8]))


def test_chain_tree_is_causal(ext) -> None:
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [6, 4], [50, 4], seed=6)
    chain = torch.tensor([-1, 0, 1, 2, 3, 4, -1, 0, 1, 2])
    causal = kernels.varlen_paged_attention(q, kc, vc, bt, cu, cl, bs, scale)
    KERNEL_FP32.assert_close(kernels.varlen_paged_attention(q, kc, vc, bt, cu, cl, bs, scale, tree_parents=chain), causal)


def test_tree_example_from_docstring(ext) -> None:
    # parents [-1, 0, 0, 2] after a 3-token prefix: token 3 sees positions 0, 1, 2, 3, 5, 6.
    assert tree_visibility([-1, 0, 0, 2]).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [4], [7], seed=7)
    out = kernels.varlen_paged_attention(q, kc, vc, bt, cu, cl, bs, scale, tree_parents=torch.tensor([-1, 0, 0, 2]))
    slots = bt[0].long()[0] * bs + torch.tensor([0, 1, 2, 3, 5, 6])
    k = kc[slots].transpose(0, 1).unsqueeze(0)  # [1, G, 6, D]
    v = vc[slots].transpose(0, 1).unsqueeze(0)
    want = F.scaled_dot_product_attention(q[3:4].transpose(0, 1).unsqueeze(0), k, v, enable_gqa=True)
    KERNEL_FP32.assert_close(out[3], want[0, :, 0])


def test_ref_matches_sdpa() -> None:
    # The reference against SDPA with a causal mask offset by the prefix, on gathered contiguous K/V.
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [9], [37], index_dtype=torch.int64, seed=8)
    t = torch.arange(37)
    slots = bt[0][t // 16] * 16 + t % 16
    k, v = kc[slots].transpose(0, 1).unsqueeze(0), vc[slots].transpose(0, 1).unsqueeze(0)
    mask = torch.arange(37)[None, :] <= torch.arange(28, 37)[:, None]  # [9, 37]
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, enable_gqa=True)
    ref = kernels.varlen_paged_attention_ref(q, kc, vc, bt, cu, cl, bs, scale)
    KERNEL_FP32.assert_close(ref, sdpa[0].transpose(0, 1))


def test_one_token_equals_decode_kernel(ext) -> None:
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [1, 1, 1], [1, 100, 700], seed=9)
    out, lse = kernels.varlen_paged_attention(q, kc, vc, bt, cu, cl, bs, scale, return_lse=True)
    dec, dec_lse = kernels.paged_decode_attention(q, kc, vc, bt, cl, bs, scale, return_lse=True)
    KERNEL_FP32.assert_close(out, dec)
    KERNEL_FP32.assert_close(lse, dec_lse)


def test_large_scores_are_stable(ext) -> None:
    q, kc, vc, bt, cu, cl, bs, _, parents = make_case(9, 3, 64, 16, [20], [400], seed=10, tree=True)
    # Scores ~ +-800: a different summation order moves each score by ~800 * 1e-7 * 8 ~ 5e-4, and a
    # softmax weight by as much relative, hence the looser bound; overflow or a bad max would give
    # NaN/inf or errors of order 1: KERNEL_FP32 x 200 = 2e-3, 4x that.
    out = kernels.varlen_paged_attention(q * 100, kc, vc, bt, cu, cl, bs, 1.0, tree_parents=parents)
    ref = kernels.varlen_paged_attention_ref(q * 100, kc, vc, bt, cu, cl, bs, 1.0, tree_parents=parents)
    assert torch.isfinite(out).all()
    KERNEL_FP32.times(200).assert_close(out, ref)


def test_strided_q_and_out_param(ext) -> None:
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [3, 5], [10, 40], seed=11)
    T, H, D = q.shape
    qkv = torch.randn(T, (H + 6) * D)
    qkv[:, : H * D] = q.reshape(T, H * D)
    q_view = qkv[:, : H * D].view(T, H, D)  # rows (H + 2G) * D floats apart, as in the model
    buf = torch.full((T + 2, H, D), float("nan"))
    res = kernels.varlen_paged_attention(q_view, kc, vc, bt, cu, cl, bs, scale, out=buf[2:])
    assert res.data_ptr() == buf[2:].data_ptr()
    KERNEL_FP32.assert_close(buf[2:], kernels.varlen_paged_attention_ref(q, kc, vc, bt, cu, cl, bs, scale))
    assert torch.isnan(buf[:2]).all()


def test_bad_input_raises(ext) -> None:
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [4], [40], seed=12)
    run = lambda **kw: ext.varlen_paged_attention(  # noqa: E731
        kw.get("q", q), kc, vc, kw.get("bt", bt), kw.get("cu", cu), kw.get("cl", cl), bs, scale,
        kw.get("parents"), None, False,
    )
    with pytest.raises(RuntimeError, match="tree_parents\\[2\\] = 2"):
        run(parents=torch.tensor([-1, 0, 2, 1]))  # a token cannot be its own parent
    with pytest.raises(RuntimeError, match="context_lens\\[0\\] = 3 is less than its 4 new tokens"):
        run(cl=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="columns"):
        run(bt=bt[:, :2])  # 40 tokens need 3 blocks
    with pytest.raises(RuntimeError, match="cu_seqlens_q\\[-1\\]"):
        run(cu=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        run(q=torch.randn(4, 8, 64))
    with pytest.raises(ValueError, match="tree_parents\\[1\\] = 1"):
        tree_visibility([-1, 1])
