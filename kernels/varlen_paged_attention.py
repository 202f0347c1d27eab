"""Attention of several new tokens per sequence over the paged KV cache: prefill chunks (causal) and
speculative verification (causal or a token tree). Everything is read from the cache through the
block tables: the new tokens' K/V must already be written (rotary_and_cache_write does that).

Layout (varlen, no padding): the new tokens of B sequences are stacked in q [T, H, D]; sequence b
owns rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (n_b rows) and has context_lens[b] = ctx_b
tokens in the cache, the last n_b of which are its new tokens. With P_b = ctx_b - n_b (the cached
prefix), new token i sits at position P_b + i and sees
    - the prefix: every position t < P_b, and
    - causal (tree_parents None): the new tokens j <= i;
    - tree: the new tokens j that are i itself or one of its ancestors.
For query head h (kv head g = h // (H // G), GQA):
    out[row, h] = sum_t softmax_t(scale * q[row, h] . K_t) V_t    over the visible t
    lse[row, h] = log sum_t exp(scale * q[row, h] . K_t)          (natural log; returned on request)
A sequence with n_b = 0 has no rows (an empty sequence is fine).

Tree format (speculative token trees): tree_parents [T] int, one entry per query row; for row
cu_seqlens_q[b] + i it is the parent of new token i as an index among the same sequence's new
tokens, or -1 if its parent is the last prefix token (a root). Parents come first: -1 <= parent < i
(topological order, as a tree flattened breadth- or depth-first). A chain parents = [-1, 0, 1, ...]
is exactly the causal case. `tree_visibility(parents)` gives the equivalent [n, n] bool mask.

Worked example (tree): a prefix of P = 3 tokens and 4 draft tokens, a root "a" (0) with children
"b" (1) and "c" (2), and "d" (3) under "c": tree_parents = [-1, 0, 0, 2]. Token 3 ("d") sees the 3
prefix positions and new tokens {0, 2, 3}, i.e. cache positions 0, 1, 2, 3, 5, 6; token 1 ("b")
sees 0, 1, 2, 3, 4.

Dispatch: fp32 or bf16 CPU tensors -> the C++ kernel (varlen_attention.cpp: per kv head, a block of up to 16
queries x H/G heads shares every K/V run loaded; online softmax over 128-key chunks; long contexts
split across threads and merged exactly when there are few query blocks). CUDA tensors -> the
Triton kernel (kernels/triton_ops/varlen_paged_attention.py) if triton is installed. Anything else
-> `varlen_paged_attention_ref` (gather + masked softmax in torch), counted as a fallback.

Axes: T query rows, B sequences, H query heads, G kv heads, D head dim, S cache slots, L context.
"""

from __future__ import annotations

import torch

from kernels import _build, _triton

_F32 = torch.float32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel takes


def tree_visibility(parents: list[int] | torch.Tensor) -> torch.Tensor:
    """[n, n] bool: entry [i, j] is True iff new token j is i or an ancestor of i.

    parents: one sequence's tree (see the module doc). Example: [-1, 0, 0, 2] ->
    [[1,0,0,0], [1,1,0,0], [1,0,1,0], [1,0,1,1]].
    """
    par = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    n = len(par)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(par):
        if not -1 <= p < i:
            raise ValueError(f"tree_parents[{i}] = {p}: must be in [-1, {i}) (a parent comes before its child)")
        if p >= 0:
            vis[i] = vis[p]
        vis[i, i] = True
    return vis


def varlen_kernel_available(q: torch.Tensor) -> bool:
    """True if `varlen_paged_attention` would run a kernel (C++ or Triton) on tensors like q rather
    than its reference: callers with a faster plain path of their own (SDPA) pick by this."""
    if q.is_cpu:
        return q.dtype in _KERNEL_DTYPES and _build.ext() is not None
    return q.is_cuda and _triton.triton_available()


def varlen_paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    cu_seqlens_q: torch.Tensor,  # [B + 1] int
    context_lens: torch.Tensor,  # [B] int, including the new tokens
    block_size: int,
    scale: float,
    tree_parents: torch.Tensor | None = None,  # [T] int, see the module doc
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D] (, lse [T, H] fp32)
    T, H, D = q.shape
    G = k_cache.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((T, H), float("-inf"), dtype=_F32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        r0, r1 = cu[b], cu[b + 1]
        n = r1 - r0
        if n == 0:
            continue
        if ctx < n:
            raise ValueError(f"context_lens[{b}] = {ctx} is less than its {n} new tokens")
        prefix = ctx - n
        t = torch.arange(ctx, device=q.device)
        slots = block_tables[b].long()[t // block_size] * block_size + t % block_size  # [L]
        k = k_cache[slots].float().repeat_interleave(H // G, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(H // G, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[r0:r1].float(), k) * scale  # [H, n, L]
        if tree_parents is None:
            new_vis = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            new_vis = tree_visibility(tree_parents[r0:r1])
        visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool), new_vis], dim=1).to(q.device)  # [n, L]
        s = s.masked_fill(~visible, float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [H, n]
        p = torch.exp(s - l[..., None])
        out[r0:r1] = torch.einsum("hnl,lhd->nhd", p, v).to(q.dtype)
        lse[r0:r1] = l.T
    return (out, lse) if return_lse else out


def varlen_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32/int64
    context_lens: torch.Tensor,  # [B] int32/int64, including the new tokens
    block_size: int,
    scale: float,
    tree_parents: torch.Tensor | None = None,  # [T] int32/int64, see the module doc
    out: torch.Tensor | None = None,  # [T, H, D]: written in place when given
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D] (, lse [T, H] fp32)
    if q.is_cpu and q.dtype in _KERNEL_DTYPES:
        ext = _build.ext()
        if ext is not None:
            o, lse = ext.varlen_paged_attention(
                q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, block_size, scale, tree_parents, out,
                return_lse,
            )
            return (o, lse) if return_lse else o
        _build.note_ref_path("varlen_paged_attention")
    elif q.is_cuda and _triton.triton_available():
        return _triton.ops("varlen_paged_attention").varlen_paged_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, block_size, scale, tree_parents, out,
            return_lse,
        )
    else:
        _build.note_fallback("varlen_paged_attention", _build.no_kernel_reason(q))
    res = varlen_paged_attention_ref(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, block_size, scale, tree_parents, return_lse
    )
    o = res[0] if isinstance(res, tuple) else res  # a tuple exactly when return_lse
    if out is not None:
        o = out.copy_(o)
    return (o, res[1]) if return_lse else o
