"""Attention over the paged KV cache for a flat batch of tokens (no padding between requests).

A step's tokens are laid out as [decode tokens (one per sequence) | prefill chunk 1 | chunk 2 ...].
Each layer first writes the new K/V into their cache slots, then attends:
  - decodes: one batched SDPA over each sequence's cached K/V gathered through its slot list
    (padded to the longest context, padding masked out);
  - a prefill chunk starting at position 0 attends only to itself (causal, no gather);
  - a chunk starting later (chunked prefill, prefix-cache hit, recompute) gathers its cached prefix
    and uses a causal mask offset by the chunk's start.
Slot lists and masks are built once per step (AttentionMetadata) and shared by all layers.

Axes: T tokens in the step, B decode sequences, L context length, S cache slots
(num_blocks * block_size), H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PrefillSpan:
    q_start: int  # first row of this chunk in the flat batch
    q_end: int
    context_slots: torch.Tensor | None  # [L] slots of the whole context; None if start_pos == 0
    mask: torch.Tensor | None  # [q_len, L] bool, True = may attend; None if start_pos == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decodes: int  # the first num_decodes tokens are decodes, one per sequence
    decode_slots: torch.Tensor | None  # [B, L] context slots per decode sequence (0-padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, None when no padding
    prefills: list[PrefillSpan]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, G, D]
        v: torch.Tensor,  # [T, G, D]
        k_cache: torch.Tensor,  # [S, G, D]
        v_cache: torch.Tensor,  # [S, G, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H * D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for span in meta.prefills:
            out[span.q_start : span.q_end] = self._prefill(q, k, v, k_cache, v_cache, span)
        return out.view(q.shape[0], -1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        slots = meta.decode_slots  # [B, L]
        kk = k_cache[slots].transpose(1, 2)  # [B, G, L, D]
        vv = v_cache[slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kk, vv, attn_mask=meta.decode_mask, enable_gqa=True
        )  # [B, H, 1, D]
        return o.squeeze(2)

    def _prefill(self, q, k, v, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        qq = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.context_slots is None:
            kk = k[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, G, n, D]
            vv = v[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        else:
            kk = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, G, L, D]
            vv = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # [n, H, D]
