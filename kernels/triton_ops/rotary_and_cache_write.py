"""Triton RoPE on q and k in place plus the K/V write into the paged cache (math:
kernels/rotary_and_cache_write.py). One program per token: all H query heads and G kv heads as
[heads, D/2] tiles (rotate-half layout), then k and v stored at the token's slot unless it is
negative (padding). Arithmetic in fp32, stored in the tensors' dtype.

Axes: T tokens, H query heads, G kv heads, D head dim (halves padded to BH), S cache slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2


@triton.jit
def _rotate_heads(x_ptr, x_sh, n_heads, c, s, half, NP: tl.constexpr, BH: tl.constexpr):
    hh = tl.arange(0, NP)
    j = tl.arange(0, BH)
    mask = (hh[:, None] < n_heads) & (j[None, :] < half)
    p1 = x_ptr + hh[:, None] * x_sh + j[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(p1, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, y2.to(x_ptr.dtype.element_ty), mask=mask)
    return y1, y2, mask


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, cos_st, sin_st, kc_ss, kc_sg, vc_ss, vc_sg,
    H, G, half,
    HP: tl.constexpr, GP: tl.constexpr, BH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BH)
    jm = j < half
    c = tl.load(cos_ptr + t * cos_st + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sin_st + j, mask=jm, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * q_st, q_sh, H, c, s, half, HP, BH)
    k1, k2, kmask = _rotate_heads(k_ptr + t * k_st, k_sh, G, c, s, half, GP, BH)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        gg = tl.arange(0, GP)
        kc = kc_ptr + slot * kc_ss + gg[:, None] * kc_sg + j[None, :]
        tl.store(kc, k1.to(kc_ptr.dtype.element_ty), mask=kmask)
        tl.store(kc + half, k2.to(kc_ptr.dtype.element_ty), mask=kmask)
        vp = v_ptr + t * v_st + gg[:, None] * v_sh + j[None, :]
        vc = vc_ptr + slot * vc_ss + gg[:, None] * vc_sg + j[None, :]
        tl.store(vc, tl.load(vp, mask=kmask, other=0.0), mask=kmask)
        tl.store(vc + half, tl.load(vp + half, mask=kmask, other=0.0), mask=kmask)


def rotary_and_cache_write_triton(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, G, D], rotated in place
    v: torch.Tensor,  # [T, G, D]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = do not write
) -> None:
    check_device(q, "rotary_and_cache_write")
    T, H, D = q.shape
    G = k.shape[1]
    if D % 2:
        raise ValueError(f"rotary_and_cache_write: head dim must be even, got {D}")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"rotary_and_cache_write: {name} needs a contiguous last dim")
    if T:
        _rotary_cache_kernel[(T,)](
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping.contiguous(),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            H, G, D // 2,
            HP=next_pow2(H), GP=next_pow2(G), BH=next_pow2(D // 2),
        )
