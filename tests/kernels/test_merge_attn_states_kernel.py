"""merge_attn_states C++ kernel vs merge_attn_states_ref, and the property it exists for: attention
over a context split into pieces, each piece returning (out, lse), merges into attention over the
whole context (split-KV / ring attention). Tolerances as for the attention kernels (~1e-7 relative
arithmetic differences, 1e-5 bounds)."""

from __future__ import annotations

import pytest
import torch

import kernels

from test_varlen_paged_attention_kernel import make_case

from testkit.tolerance import KERNEL_FP32

NEG_INF = float("-inf")


@pytest.mark.parametrize("N,T,H,D", [(1, 3, 9, 64), (2, 5, 9, 64), (3, 4, 4, 80), (20, 2, 3, 24), (2, 300, 9, 64)])
def test_matches_ref(isa: str, N, T, H, D) -> None:
    g = torch.Generator().manual_seed(N * 100 + T)
    outs = [torch.randn(T, H, D, generator=g) for _ in range(N)]
    lses = [torch.randn(T, H, generator=g) * 5 for _ in range(N)]
    lses[0][0, 0] = NEG_INF  # an empty partial in one row
    out, lse = kernels.merge_attn_states(outs, lses)
    ref, ref_lse = kernels.merge_attn_states_ref(outs, lses)
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)


def test_all_empty_row_is_zero_and_ignores_garbage(ext) -> None:
    outs = [torch.full((2, 3, 16), float("nan")), torch.randn(2, 3, 16)]
    lses = [torch.full((2, 3), NEG_INF), torch.randn(2, 3)]
    lses[1][1] = NEG_INF  # row 1: every partial empty
    for fn in (kernels.merge_attn_states, kernels.merge_attn_states_ref):
        out, lse = fn(outs, lses)
        KERNEL_FP32.assert_close(out[0], outs[1][0])  # the NaN partial has weight 0
        assert torch.equal(out[1], torch.zeros(3, 16)) and torch.isneginf(lse[1]).all()


def test_docstring_example(ext) -> None:
    outs = [torch.tensor([[[1.0]]]), torch.tensor([[[3.0]]])]
    lses = [torch.tensor([[0.0]]), torch.tensor([[3.0]]).log()]
    out, lse = kernels.merge_attn_states(outs, lses)
    KERNEL_FP32.assert_close(out, torch.tensor([[[2.5]]]))
    KERNEL_FP32.assert_close(lse, torch.tensor([[4.0]]).log())


def _split_context(bt: torch.Tensor, ctx: list[int], cut: list[int], block_size: int):
    """Block tables and lengths for the keys [0, cut) and [cut, ctx) of each sequence (cut on a
    block boundary, so each piece is again a paged context)."""
    first = torch.tensor(cut, dtype=torch.int32)
    second_len = torch.tensor([c - k for c, k in zip(ctx, cut)], dtype=torch.int32)
    second = torch.stack([torch.roll(bt[b], -(k // block_size)) for b, k in enumerate(cut)])
    return first, second, second_len


def test_split_decode_merges_to_whole(ext) -> None:
    q, kc, vc, bt, _, cl, bs, scale, _ = make_case(9, 3, 64, 16, [1, 1], [300, 37], seed=3)
    q = torch.randn(2, 9, 64)
    cut = [160, 32]
    first_len, second_bt, second_len = _split_context(bt, cl.tolist(), cut, bs)
    o1, l1 = kernels.paged_decode_attention(q, kc, vc, bt, first_len, bs, scale, return_lse=True)
    o2, l2 = kernels.paged_decode_attention(q, kc, vc, second_bt, second_len, bs, scale, return_lse=True)
    out, lse = kernels.merge_attn_states([o1, o2], [l1, l2])
    whole, whole_lse = kernels.paged_decode_attention(q, kc, vc, bt, cl, bs, scale, return_lse=True)
    KERNEL_FP32.assert_close(out, whole)
    KERNEL_FP32.assert_close(lse, whole_lse)


def test_prefix_plus_causal_chunk_merges_to_varlen(ext) -> None:
    # Ring-attention shape: a chunk of new tokens attends to a remote prefix (no mask: decode-style
    # over the prefix for each query) and to itself (causal); merged = the full varlen attention.
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [5], [69], seed=4)
    prefix = 64
    n = 5
    bt5 = bt.expand(n, -1).contiguous()
    o1, l1 = kernels.paged_decode_attention(q, kc, vc, bt5, torch.full((n,), prefix, dtype=torch.int32), bs, scale,
                                            return_lse=True)
    own_bt = torch.roll(bt, -(prefix // bs), dims=1)
    o2, l2 = kernels.varlen_paged_attention(q, kc, vc, own_bt, cu, torch.tensor([n], dtype=torch.int32), bs, scale,
                                            return_lse=True)
    out, lse = kernels.merge_attn_states([o1, o2], [l1, l2])
    whole, whole_lse = kernels.varlen_paged_attention(q, kc, vc, bt, cu, cl, bs, scale, return_lse=True)
    KERNEL_FP32.assert_close(out, whole)
    KERNEL_FP32.assert_close(lse, whole_lse)


def test_bad_input_raises(ext) -> None:
    with pytest.raises(ValueError, match="matching"):
        kernels.merge_attn_states([torch.randn(1, 2, 4)], [])
    with pytest.raises(RuntimeError, match="lses\\[1\\] must be \\[T, H\\]"):
        kernels.merge_attn_states([torch.randn(1, 2, 4)] * 2, [torch.randn(1, 2), torch.randn(2, 2)])
