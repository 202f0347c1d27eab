"""Triton varlen paged attention: several new tokens per sequence, causal or a token tree (math and
tree format: kernels/varlen_paged_attention.py).

One program per (sequence b, block of BLOCK_M new tokens, query head h): flash attention over the
keys that block can see (positions < P + last query + 1), BLOCK_N keys per step, each key's slot
looked up through the block table. S = Q K^T and P V are tl.dot products in full fp32
(input_precision "ieee": no TF32 rounding, so results match the fp32 reference). The tree is passed
as a dense visibility mask [T, max_n] int8 built from the parents (row r = query row, column j = the
sequence's new token j); prefix keys are always visible. Rows that have seen no key yet are guarded
so no exp(-inf - -inf) NaN appears.

Axes: T query rows, B sequences, H query heads, G kv heads, D head dim (padded to BD >= 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2
from kernels.varlen_paged_attention import tree_visibility

BLOCK_M = 16  # queries per program (tl.dot needs >= 16)
BLOCK_N = 32  # keys per step


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, cl_ptr, vis_ptr, out_ptr, lse_ptr,
    q_st, q_sh, k_ss, k_sg, v_ss, v_sg, bt_sb, vis_st, o_st, o_sh, lse_st,
    block_size, scale, HPG, D,
    BD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    r0 = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - r0
    if mb * BLOCK_M < n:
        g = h // HPG
        ctx = tl.load(cl_ptr + b)
        prefix = ctx - n
        i = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] new-token index within the sequence
        qv = i < n
        d = tl.arange(0, BD)
        dmask = d < D
        rows = (r0 + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * q_st + h * q_sh + d[None, :], mask=qv[:, None] & dmask[None, :], other=0.0)
        q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BD], tl.float32)
        kend = tl.minimum(ctx, prefix + mb * BLOCK_M + BLOCK_M)
        for t0 in range(0, kend, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tv = t < kend
            blk = tl.load(bt_ptr + b * bt_sb + t // block_size, mask=tv, other=0)
            slot = blk.to(tl.int64) * block_size + t % block_size
            kv_mask = tv[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * k_ss + g * k_sg + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + slot[:, None] * v_ss + g * v_sg + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
            vis = qv[:, None] & tv[None, :] & (t[None, :] <= prefix + i[:, None])
            if HAS_TREE:
                j = t - prefix  # new-token index of each key (< 0: prefix, always visible)
                new = vis & (j[None, :] >= 0)
                tree = tl.load(vis_ptr + rows[:, None] * vis_st + j[None, :], mask=new, other=1)
                vis = vis & (tree != 0)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        seen = l > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
        tl.store(out_ptr + rows[:, None] * o_st + h * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=qv[:, None] & dmask[None, :])
        if WRITE_LSE:
            lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
            tl.store(lse_ptr + rows * lse_st + h, lse, mask=qv)


def tree_mask_rows(tree_parents: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[T, max(1, max_n)] int8: row cu[b] + i, column j = 1 iff new token j is i or an ancestor of i."""
    cu = cu_seqlens_q.tolist()
    ns = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    vis = torch.zeros(cu[-1], max([1, *ns]), dtype=torch.int8)
    parents = tree_parents.cpu()
    for b, n in enumerate(ns):
        if n:
            vis[cu[b] : cu[b + 1], :n] = tree_visibility(parents[cu[b] : cu[b + 1]]).to(torch.int8)
    return vis.to(tree_parents.device)


def varlen_paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    cu_seqlens_q: torch.Tensor,  # [B + 1] int
    context_lens: torch.Tensor,  # [B] int
    block_size: int,
    scale: float,
    tree_parents: torch.Tensor | None = None,  # [T] int
    out: torch.Tensor | None = None,  # [T, H, D]
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D] (, lse [T, H] fp32)
    check_device(q, "varlen_paged_attention")
    T, H, D = q.shape
    G = k_cache.shape[1]
    B = context_lens.shape[0]
    if H % G:
        raise ValueError(f"varlen_paged_attention: query heads H = {H} must be a multiple of kv heads G = {G}")
    if cu_seqlens_q.shape != (B + 1,):
        raise ValueError(f"varlen_paged_attention: cu_seqlens_q must be [B + 1 = {B + 1}], got {tuple(cu_seqlens_q.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"varlen_paged_attention: {name} needs a contiguous last dim")
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    n_max = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if B else 0
    if n_max == 0:
        lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    vis = tree_mask_rows(tree_parents, cu_seqlens_q) if tree_parents is not None else lse  # lse: unused placeholder
    grid = (B, triton.cdiv(n_max, BLOCK_M), H)
    _varlen_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q.contiguous(), context_lens.contiguous(), vis, out, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), vis.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        block_size, float(scale), H // G, D,
        BD=max(16, next_pow2(D)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_TREE=tree_parents is not None,
        WRITE_LSE=return_lse,
    )
    return (out, lse) if return_lse else out
