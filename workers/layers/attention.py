"""Attention over the paged KV cache for a flat batch of tokens (no padding between requests).

A step's tokens are laid out as [single-token chunks (decodes), one per sequence | prefill chunk 1
| chunk 2 ...]. Each layer first rotates q/k and writes the new K/V into their cache slots (one fused
call), then attends:
  - decodes: ``kernels.paged_decode_attention`` reads each sequence's K/V straight from its
    blocks (no gather copy);
  - prefill chunks: ``kernels.varlen_paged_attention`` attends all of them in one call, each chunk
    to its cached prefix and causally to itself, reading K/V straight from the blocks (no gather,
    no mask tensor); used whenever a kernel exists for q (fp32 CPU with the C++ kernels, CUDA with
    triton). Otherwise the plain path runs per chunk: a chunk starting at position 0 attends only
    to itself (causal SDPA, no gather); a chunk starting later (chunked prefill, prefix-cache hit,
    recompute) gathers its cached prefix and uses a causal mask offset by the chunk's start.
    Both paths give the same tokens (tests/workers/layers/test_prefill_attention_paths.py).
  - sequence-parallel prefill chunks (the last rows of the step, ``meta.ring``): each rank holds
    its zigzag pieces of a long chunk and attends by ring attention over the sp group
    (workers/layers/ring_attention.py), which also fills its cache with the other ranks' K/V.
The metadata is built once per step (AttentionMetadata, workers/layers/attention_metadata.py) and
shared by all layers.

Axes: T tokens in the step, B decode sequences, L context length, S cache slots
(num_blocks * block_size), H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.paged_decode_attention import paged_decode_attention
from kernels.rotary_and_cache_write import rotary_and_cache_write
from kernels.varlen_paged_attention import varlen_kernel_available, varlen_paged_attention
from workers.layers.attention_metadata import AttentionMetadata, PrefillSpan
from workers.layers.context_attention import context_attention
from workers.layers.ring_attention import ring_attention
from workers.parallel.groups import get_group


class PagedAttention(nn.Module):
    """``window`` (sliding-window attention: a query at p sees keys p - window + 1 .. p) and
    ``softcap`` (scores capped as cap * tanh(s / cap)) run the plain torch path of
    workers/layers/context_attention.py; ``scale`` defaults to D^-0.5."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D], rotated in place
        k: torch.Tensor,  # [T, G, D], rotated in place
        v: torch.Tensor,  # [T, G, D]
        cos: torch.Tensor,  # [T, D/2] rotary cos at each token's position
        sin: torch.Tensor,  # [T, D/2]
        k_cache: torch.Tensor,  # [S, G, D]
        v_cache: torch.Tensor,  # [S, G, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H * D]
        rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        if self.window is not None or self.softcap is not None:
            assert not meta.ring, "sequence parallelism is refused at the config edge for these variants"
            out = context_attention(q, lambda slots: (k_cache[slots], v_cache[slots]), meta, self.scale,
                                    self.window, self.softcap)  # [T, H, D]
            return out.view(q.shape[0], -1)
        if meta.ring:
            return self._with_ring(q, k, v, k_cache, v_cache, meta)
        return self._attend(q, k, v, k_cache, v_cache, meta)

    def _attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Decodes and (replicated) prefill chunks, K/V already in the cache -> [T, H * D]."""
        nd = meta.num_decodes
        if nd == q.shape[0]:  # decode-only step: the kernel output is the whole result
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            res = paged_decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.block_size, self.scale
            )
            assert isinstance(res, torch.Tensor)  # no lse asked for
            return res.view(nd, -1)
        out = torch.empty_like(q)
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.block_size,
                self.scale, out=out[:nd],
            )
        if meta.prefill_cu_seqlens is not None and varlen_kernel_available(q):
            assert meta.prefill_block_tables is not None and meta.prefill_context_lens is not None
            varlen_paged_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens,
                meta.prefill_context_lens, meta.block_size, self.scale, out=out[nd:],
            )
        else:
            for span in meta.prefills:
                out[span.q_start : span.q_end] = self._prefill(q, k, v, k_cache, v_cache, span)
        return out.view(q.shape[0], -1)

    def _with_ring(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Rows before the ring chunks as usual, then each ring chunk (rotation and local cache
        writes are already done)."""
        out = torch.empty_like(q)
        n = meta.ring[0].row_start  # rows handled by the plain paths
        if n:
            plain = AttentionMetadata(meta.block_size, meta.slot_mapping[:n], meta.num_decodes,
                                      meta.decode_block_tables, meta.decode_context_lens, meta.prefills,
                                      meta.prefill_block_tables, meta.prefill_cu_seqlens, meta.prefill_context_lens)
            out[:n] = self._attend(q[:n], k[:n], v[:n], k_cache, v_cache, plain).view(n, *q.shape[1:])
        sp = get_group("sp")
        for rc in meta.ring:
            rows = slice(rc.row_start, rc.row_start + rc.num_rows)
            out[rows] = ring_attention(q[rows], k[rows], v[rows], k_cache, v_cache, rc, sp, self.scale)
        return out.view(q.shape[0], -1)

    def _prefill(self, q, k, v, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        qq = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.context_slots is None:
            kk = k[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, G, n, D]
            vv = v[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        else:
            kk = k_cache[span.context_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, G, L, D]
            vv = v_cache[span.context_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # [n, H, D]
