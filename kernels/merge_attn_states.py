"""Merge partial attention outputs computed over disjoint key sets, using their log-sum-exps.

Ring attention and split-KV (flash-decoding) compute attention of the same queries over pieces of
the context: partial p returns its softmax-normalised output o_p and lse_p = log sum_{t in p}
exp(s_t). The exact attention over all keys is, per (token, head) row:
    M   = max_p lse_p
    w_p = exp(lse_p - M)
    out = sum_p w_p o_p / sum_p w_p
    lse = M + log sum_p w_p            (so merges compose: merge(merge(a, b), c) = merge(a, b, c))
A partial with lse = -inf (it saw no key) counts for nothing; a row where every lse is -inf becomes
zeros with lse -inf.

Worked example (one row, D = 1): o_1 = [1], lse_1 = log 1 = 0 (one key, score 0); o_2 = [3],
lse_2 = log 3 (three keys, scores 0): M = log 3, w = [1/3, 1] -> out = (1/3 * 1 + 1 * 3) / (4/3) =
[2.5], the mean of the four values; lse = log 3 + log(4/3) = log 4.

The partial-attention kernels return what this needs: `paged_decode_attention(...,
return_lse=True)` and `varlen_paged_attention(..., return_lse=True)` give (out, lse [T, H] fp32).

Dispatch: fp32 CPU tensors -> the C++ kernel (merge_attn_states.cpp, one pass over the partials);
CUDA -> the Triton kernel (kernels/triton_ops/merge_attn_states.py) if triton is installed;
anything else -> `merge_attn_states_ref`, counted as a fallback.

Axes: N partials, T tokens, H heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import _build, _triton

_F32 = torch.float32


def merge_attn_states_ref(
    outs: Sequence[torch.Tensor],  # N x [T, H, D]
    lses: Sequence[torch.Tensor],  # N x [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, H, D], lse [T, H] fp32)
    o = torch.stack([x.float() for x in outs])  # [N, T, H, D]
    l = torch.stack([x.float() for x in lses])  # [N, T, H]
    m = l.max(dim=0).values  # [T, H]
    empty = m == float("-inf")
    w = torch.exp(l - torch.where(empty, 0.0, m))  # [N, T, H]; 0 for lse = -inf
    total = w.sum(dim=0)  # [T, H]
    # Weight-0 partials may hold anything (an empty partial's rows): keep them out of the sum.
    contrib = torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(dim=0)
    out = torch.where(empty[..., None], 0.0, contrib / torch.where(empty, 1.0, total)[..., None])
    lse = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, total)))
    return out.to(outs[0].dtype), lse


def merge_attn_states(
    outs: Sequence[torch.Tensor],  # N x [T, H, D]
    lses: Sequence[torch.Tensor],  # N x [T, H] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, H, D], lse [T, H] fp32)
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_attn_states: need matching, non-empty outs and lses, got {len(outs)} and {len(lses)}")
    x = outs[0]
    if x.is_cpu and x.dtype is _F32 and all(t.dtype is _F32 for t in (*outs, *lses)):
        ext = _build.ext()
        if ext is not None:
            return ext.merge_attn_states(list(outs), list(lses))
        _build.note_ref_path("merge_attn_states")
    elif x.is_cuda and _triton.triton_available():
        return _triton.ops("merge_attn_states").merge_attn_states_triton(outs, lses)
    else:
        _build.note_fallback("merge_attn_states", _build.no_kernel_reason(x))
    return merge_attn_states_ref(outs, lses)
