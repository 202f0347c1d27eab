"""Triton merge of partial attention outputs by their log-sum-exps (math: kernels/merge_attn_states.py).

One program per (token, head) row: a first pass over the N partials finds M = max lse_p, a second
accumulates w_p o_p with w_p = exp(lse_p - M) (skipping weight-0 partials, whose rows may hold
anything). The partials are stacked into [N, T, H, D] / [N, T, H] first (one copy; N is small).

Axes: N partials, T tokens, H heads, D head dim (padded to BD).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels._triton import check_device, next_pow2


@triton.jit
def _merge_kernel(o_ptr, l_ptr, out_ptr, lse_ptr, N, rows, D, BD: tl.constexpr):
    r = tl.program_id(0)
    d = tl.arange(0, BD)
    dmask = d < D
    # Loop-carried values start as tensors (partial 0), not Python floats, so their types never change.
    M = tl.load(l_ptr + r)
    for p in range(1, N):
        M = tl.maximum(M, tl.load(l_ptr + p * rows + r))
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    W = tl.exp(tl.load(l_ptr + r) - M_safe)
    acc = tl.where(W > 0, W * tl.load(o_ptr + r.to(tl.int64) * D + d, mask=dmask, other=0.0).to(tl.float32), 0.0)
    for p in range(1, N):
        w = tl.exp(tl.load(l_ptr + p * rows + r) - M_safe)
        o = tl.load(o_ptr + (p * rows + r).to(tl.int64) * D + d, mask=dmask, other=0.0).to(tl.float32)
        acc += tl.where(w > 0, w * o, 0.0)
        W += w
    seen = W > 0
    out = tl.where(seen, acc / tl.where(seen, W, 1.0), 0.0)
    tl.store(out_ptr + r.to(tl.int64) * D + d, out.to(out_ptr.dtype.element_ty), mask=dmask)
    tl.store(lse_ptr + r, tl.where(seen, M + tl.log(tl.where(seen, W, 1.0)), float("-inf")))


def merge_attn_states_triton(
    outs: Sequence[torch.Tensor],  # N x [T, H, D]
    lses: Sequence[torch.Tensor],  # N x [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, H, D], lse [T, H] fp32)
    check_device(outs[0], "merge_attn_states")
    o = torch.stack(list(outs)).contiguous()  # [N, T, H, D]
    l = torch.stack([x.float() for x in lses]).contiguous()  # [N, T, H]
    N, T, H, D = o.shape
    if l.shape != (N, T, H):
        raise ValueError(f"merge_attn_states: lses must be {N} x [T, H] = [{T}, {H}], got {tuple(l.shape)}")
    out = torch.empty(T, H, D, dtype=o.dtype, device=o.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=o.device)
    if T * H:
        _merge_kernel[(T * H,)](o, l, out, lse, N, T * H, D, BD=next_pow2(D))
    return out, lse
