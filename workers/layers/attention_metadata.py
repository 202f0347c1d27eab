"""What one step's attention needs to know about its flat batch, built once per step by the model
runner and shared by every attention layer (workers/layers/attention.py) and by the gathered-context
path (workers/layers/context_attention.py).

Axes: T tokens in the step, B decode sequences, P prefill chunks, L context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.layers.ring_attention import RingChunk


@dataclass(frozen=True)
class PrefillSpan:
    q_start: int  # first row of this chunk in the flat batch
    q_end: int
    context_slots: torch.Tensor | None  # [L] slots of the whole context; None if start_pos == 0
    mask: torch.Tensor | None  # [q_len, L] bool, True = may attend; None if start_pos == 0


@dataclass(frozen=True)
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decodes: int  # the first num_decodes tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor | None  # [B] int32, including the new token
    prefills: list[PrefillSpan]
    # The same prefill chunks as one varlen batch (rows num_decodes.. of the step), for the kernel:
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks] int32, padded with 0
    prefill_cu_seqlens: torch.Tensor | None = None  # [P + 1] int32, rows relative to num_decodes
    prefill_context_lens: torch.Tensor | None = None  # [P] int32: chunk start + chunk length
    # Sequence parallel: chunks split over the sp ranks, after every other row of the step.
    ring: tuple[RingChunk, ...] = ()
