"""Decode attention straight from the paged KV cache: one query token per sequence.

For sequence b with context length L_b and query head h (kv head g = h // (H // G), GQA):
    slot(b, t)  = block_tables[b, t // block_size] * block_size + t % block_size,   t < L_b
    s_t         = scale * q[b, h] . k_cache[slot(b, t), g]
    out[b, h]   = sum_t softmax(s)_t * v_cache[slot(b, t), g]
    lse[b, h]   = log sum_t exp(s_t)        (natural log, fp32; only with return_lse=True)
A sequence with L_b = 0 gets zeros (and lse -inf). The lse lets partial attentions over disjoint
pieces of a context be merged exactly (kernels.merge_attn_states: ring attention, split-KV).

Worked example (block_size 2, one head, D = 1, scale 1): block_tables[0] = [3, 1], L_0 = 3 -> the
tokens live in slots 6, 7, 2. With k_cache[6, 7, 2] = [0, 0, 0] the scores are equal, so out is the
mean of v_cache[6], v_cache[7], v_cache[2].

Dispatch: fp32 or bf16 CPU tensors -> the C++ kernel, which reads K/V rows in place (no gather copy, no
transposes), shares each K/V row among the H/G query heads of its group, and splits long contexts
across both cores (flash-decoding partial softmaxes, merged exactly). CUDA tensors -> the Triton
kernel (kernels/triton_ops/paged_decode_attention.py) if triton is installed. Anything else ->
`paged_decode_attention_ref` (gather + softmax in torch), counted as a fallback. bf16 q and cache:
scores, softmax and sums in fp32 (as the reference), each output row rounded to bf16 once.

Axes: B sequences, H query heads, G kv heads, D head dim, S cache slots (num_blocks * block_size).
"""

from __future__ import annotations

import torch

from kernels import _build, _triton

_F32 = torch.float32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel takes


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] int
    block_size: int,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [B, H, D] (, lse [B, H] fp32)
    B, H, D = q.shape
    G = k_cache.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((B, H), float("-inf"), dtype=_F32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        t = torch.arange(length, device=q.device)
        slots = block_tables[b].long()[t // block_size] * block_size + t % block_size  # [L]
        k = k_cache[slots].transpose(0, 1).repeat_interleave(H // G, dim=0)  # [H, L, D]
        v = v_cache[slots].transpose(0, 1).repeat_interleave(H // G, dim=0)  # [H, L, D]
        s = torch.einsum("hd,hld->hl", q[b].float(), k.float()) * scale  # [H, L]
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hl,hld->hd", p, v.float()).to(q.dtype)
        lse[b] = torch.logsumexp(s, dim=-1)
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] int32/int64
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D]: written in place when given
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out [B, H, D] (, lse [B, H] fp32)
    if q.is_cpu and q.dtype in _KERNEL_DTYPES:
        ext = _build.ext()
        if ext is not None:
            if not return_lse:
                return ext.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out)
            lse = torch.empty(q.shape[0], q.shape[1], dtype=_F32)
            o = ext.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out, lse)
            return o, lse
        _build.note_ref_path("paged_decode_attention")
    elif q.is_cuda and _triton.triton_available():
        return _triton.ops("paged_decode_attention").paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out, return_lse
        )
    else:
        _build.note_fallback("paged_decode_attention", _build.no_kernel_reason(q))
    res = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, return_lse)
    o = res[0] if isinstance(res, tuple) else res  # a tuple exactly when return_lse
    if out is not None:
        o = out.copy_(o)
    return (o, res[1]) if return_lse else o
