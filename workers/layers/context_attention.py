"""Attention over the paged KV cache in plain torch, one sequence at a time, for the variants the
kernels do not build: a sliding window (Mistral, Gemma 2/3 local layers, Phi-3), logit
soft-capping (Gemma 2) and multi-head latent attention (DeepSeek; workers/layers/mla.py brings
its own key/value function).

For each sequence of the step (a decode row or a prefill chunk) it gathers the cache slots of the
keys the chunk may see and computes, per query at position p and key at position j,
    s = scale * q . k_j ;  s = cap * tanh(s / cap) (soft-capping) ;
    allowed iff j <= p and p - j < window ;  out = softmax(s) v
With a window only the last ``window + chunk - 1`` slots of a context are gathered, so a decode
reads ``window`` keys, whatever the context length.

Axes: T tokens in the step, H query heads, G kv heads, D head dim, L keys of one sequence, n rows
of one chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from workers.layers.attention_metadata import AttentionMetadata


def sequence_slots(meta: AttentionMetadata) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, end row, slots [L] of the whole context incl. the chunk) for every sequence of the
    step: the decode rows (one each), then each prefill chunk."""
    bs = meta.block_size
    for i in range(meta.num_decodes):
        assert meta.decode_context_lens is not None and meta.decode_block_tables is not None
        n_ctx = int(meta.decode_context_lens[i])
        blocks = meta.decode_block_tables[i, : (n_ctx + bs - 1) // bs].long()  # [nb]
        slots = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).reshape(-1)[:n_ctx]
        yield i, i + 1, slots
    for span in meta.prefills:
        slots = span.context_slots if span.context_slots is not None else meta.slot_mapping[span.q_start:span.q_end]
        yield span.q_start, span.q_end, slots.long()


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None) -> torch.Tensor:
    """q [n, H, Dq], k [L, G, Dq], v [L, G, Dv] (the chunk's queries are the last n positions of the
    L keys) -> [n, H, Dv]."""
    n, h = q.shape[0], q.shape[1]
    n_ctx, g = k.shape[0], k.shape[1]
    k = k.repeat_interleave(h // g, dim=1)  # [L, H, Dq]
    v = v.repeat_interleave(h // g, dim=1)  # [L, H, Dv]
    s = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * scale  # [H, n, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(n_ctx - n, n_ctx, device=q.device)[:, None]  # [n, 1]
    kpos = torch.arange(n_ctx, device=q.device)[None, :]  # [1, L]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)  # [H, n, L]
    return torch.einsum("hnl,lhd->nhd", p, v.float()).to(q.dtype)


KVFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # slots [L] -> k [L, G, Dq], v [L, G, Dv]


def context_attention(q: torch.Tensor, kv_of: KVFn, meta: AttentionMetadata, scale: float,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, Dq] -> [T, H, Dv], every sequence of the step attending to its cached context
    (keys and values of slots from ``kv_of``, which the caller has already written this step's rows into)."""
    out: torch.Tensor | None = None
    for start, end, slots in sequence_slots(meta):
        if window is not None:
            slots = slots[max(0, slots.shape[0] - (window + end - start - 1)):]
        k, v = kv_of(slots)
        k, v = k.to(q.dtype), v.to(q.dtype)  # a bf16 cache under fp32 activations (cache.kv_cache_dtype); else no-op
        o = attend_chunk(q[start:end], k, v, scale, window, softcap)  # [n, H, Dv]
        if out is None:
            out = o.new_empty(q.shape[0], *o.shape[1:])
        out[start:end] = o
    assert out is not None, "a step has at least one sequence"
    return out
