"""Triton paged decode attention (math: kernels/paged_decode_attention.py).

One program per (sequence b, kv head g): the H/G query heads of the group are the rows of one tile
(padded to a power of two), so every K/V tile gathered from the cache is used by all of them. Keys
go in tiles of BLOCK_N tokens, each token's slot looked up through the block table (no gather copy),
with an online softmax (running max m, sum l, unnormalised acc). Scores and the P.V product are
broadcast-multiply-and-sum rather than tl.dot, which needs >= 16 rows: a group has 1-8 heads.
Inputs are cast to fp32 after loading (the interpreter's bf16 arithmetic is wrong; on GPU it is the
accurate choice anyway); the output is stored in q's dtype, the lse in fp32.

Axes: B sequences, H query heads, G kv heads, D head dim (padded to BD), HP heads per group (padded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2

BLOCK_N = 32  # keys per tile


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, lse_ptr,
    q_sb, q_sh, k_ss, k_sg, v_ss, v_sg, bt_sb, o_sb, o_sh, lse_sb,
    block_size, scale, HPG, D,
    HP: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    hh = tl.arange(0, HP)
    d = tl.arange(0, BD)
    hmask = hh < HPG
    dmask = d < D
    heads = g * HPG + hh  # [HP] query heads of this group
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32)  # [HP, BD]
    ctx = tl.load(cl_ptr + b)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BD], tl.float32)
    for t0 in range(0, ctx, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tv = t < ctx
        blk = tl.load(bt_ptr + b * bt_sb + t // block_size, mask=tv, other=0)
        slot = (blk.to(tl.int64) * block_size + t % block_size)  # [BLOCK_N]
        kv_mask = tv[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * k_ss + g * k_sg + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + slot[:, None] * v_ss + g * v_sg + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [HP, BLOCK_N]
        s = tl.where(tv[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: the tile holds >= 1 valid key
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    seen = l > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None] & dmask[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * lse_sb + heads, lse, mask=hmask)


def paged_decode_attention_triton(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D]
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [B, H, D] (, lse [B, H] fp32)
    check_device(q, "paged_decode_attention")
    B, H, D = q.shape
    G = k_cache.shape[1]
    if H % G:
        raise ValueError(f"paged_decode_attention: query heads H = {H} must be a multiple of kv heads G = {G}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_decode_attention: {name} needs a contiguous last dim")
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B:
        _paged_decode_kernel[(B, G)](
            q, k_cache, v_cache, block_tables, context_lens.contiguous(), out, lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1), lse.stride(0),
            block_size, float(scale), H // G, D,
            HP=next_pow2(H // G), BD=next_pow2(D), BLOCK_N=BLOCK_N, WRITE_LSE=return_lse,
        )
    return (out, lse) if return_lse else out
