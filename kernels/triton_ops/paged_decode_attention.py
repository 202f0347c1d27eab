"""Triton paged decode attention (math: kernels/paged_decode_attention.py).

One program per (sequence b, kv head g, key split): the H/G query heads of the group are the rows of
one tile (padded to a power of two), so every K/V tile gathered from the cache is used by all of
them. Keys go in tiles of BLOCK_N tokens, each token's slot looked up through the block table (no
gather copy), with an online softmax (running max m, sum l, unnormalised acc). When B * G programs
cannot fill a GPU (few sequences, long contexts), the keys are split into up to MAX_SPLITS ranges of
>= SPLIT_TOKENS (flash-decoding); each split writes its partial output and lse, and the Triton
merge_attn_states kernel combines them exactly. The split count comes from the block-table width
(an upper bound on every context), so no device-to-host sync is needed. Scores and the P.V product are
fp32 ``tl.dot``s (IEEE, not TF32) over a head tile padded to at least 16 rows (tl.dot's minimum; a
group has 1-8 heads, the padding rows are masked): a broadcast-multiply-and-sum over [heads, keys,
head dim] would hold a whole 3-D tile in registers, spill it to local memory and run an order of
magnitude slower. Inputs are cast to fp32 after loading (the interpreter's bf16 arithmetic is wrong;
on GPU it is the accurate choice anyway); the output is stored in q's dtype, the lse in fp32.

Axes: B sequences, H query heads, G kv heads, D head dim (padded to BD), HP heads per group (padded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2

BLOCK_N = 32  # keys per tile
SPLIT_TOKENS = 512  # shortest key range worth its own program
MAX_SPLITS = 16
MIN_PROGRAMS = 128  # B * G at or above this fills the GPU without splitting


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, lse_ptr,
    q_sb, q_sh, k_ss, k_sg, v_ss, v_sg, bt_sb, o_ss, o_sb, o_sh, lse_ss, lse_sb,
    block_size, scale, HPG, D, split_len,
    HP: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    out_ptr += split * o_ss
    lse_ptr += split * lse_ss
    hh = tl.arange(0, HP)
    d = tl.arange(0, BD)
    hmask = hh < HPG
    dmask = d < D
    heads = g * HPG + hh  # [HP] query heads of this group
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32)  # [HP, BD]
    t_begin = split * split_len
    t_end = tl.minimum(tl.load(cl_ptr + b), t_begin + split_len)  # keys [t_begin, t_end) of this split
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BD], tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tv = t < t_end
        blk = tl.load(bt_ptr + b * bt_sb + t // block_size, mask=tv, other=0)
        slot = (blk.to(tl.int64) * block_size + t % block_size)  # [BLOCK_N]
        kv_mask = tv[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * k_ss + g * k_sg + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + slot[:, None] * v_ss + g * v_sg + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [HP, BLOCK_N]
        s = tl.where(tv[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: the tile holds >= 1 valid key
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
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
    num_splits: int | None = None,  # key splits per sequence; None = by occupancy (see the module doc)
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
    if not B:
        return (out, lse) if return_lse else out
    max_ctx = block_tables.shape[1] * block_size  # bound on every context, known without a sync
    if num_splits is None:
        num_splits = 1 if B * G >= MIN_PROGRAMS else max(1, min(MAX_SPLITS, -(-max_ctx // SPLIT_TOKENS)))
        # Split boundaries at multiples of SPLIT_TOKENS from the sequence start, whatever the table
        # width: a sequence's result then does not depend on how wide its step's block table is
        # (a CUDA graph's static table is max_model_len wide; splits past the context are empty and
        # merge as exact zeros), as long as the context fits MAX_SPLITS * SPLIT_TOKENS keys.
        split_len = SPLIT_TOKENS * -(-max(max_ctx, 1) // (SPLIT_TOKENS * num_splits)) if num_splits > 1 else max_ctx
    else:
        split_len = -(-max(max_ctx, 1) // num_splits)
    split_len = max(split_len, 1)
    if num_splits == 1:
        part_out, part_lse = out, lse  # [1 x] B, H, D written in place
    else:
        part_out = torch.empty(num_splits, B, H, D, dtype=torch.float32, device=q.device)  # no bf16 rounding
        part_lse = torch.empty(num_splits, B, H, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, G, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens.contiguous(), part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), part_out.stride(0) if num_splits > 1 else 0, part_out.stride(-3),
        part_out.stride(-2), part_lse.stride(0) if num_splits > 1 else 0, part_lse.stride(-2),
        block_size, float(scale), H // G, D, split_len,
        HP=max(16, next_pow2(H // G)), BD=max(16, next_pow2(D)), BLOCK_N=BLOCK_N, WRITE_LSE=return_lse or num_splits > 1,
    )
    if num_splits > 1:
        from kernels.triton_ops.merge_attn_states import merge_attn_states_triton

        merged, lse = merge_attn_states_triton(list(part_out), list(part_lse))
        out.copy_(merged)
    return (out, lse) if return_lse else out
