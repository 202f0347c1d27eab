"""Rotary position embedding (RoPE), rotate-half layout as in HF Llama/Qwen2 checkpoints.

For a head vector x = [x1 | x2] (two halves of D/2) at position p with frequencies f (D/2 of them):
    rope(x) = [x1 * cos(p f) - x2 * sin(p f) | x2 * cos(p f) + x1 * sin(p f)]
Supported scalings ('rope_type'): default, linear (positions / factor) and llama3 (Llama 3.1's
frequency-dependent interpolation). Others raise a ConfigError naming the type. The rotation itself
is applied by ``kernels.rotary_and_cache_write``, fused with the KV-cache write.

Axes: T tokens, D head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from workers.errors import ConfigError


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies [D/2] after the checkpoint's scaling rule."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, D] holding [cos | sin] of the D/2 frequencies. A plain attribute, not a
        # buffer: it stays fp32 (like HF) when the model is cast to bf16/fp16. It is created on the
        # device the model is built under (``with torch.device(...)`` in the loader).
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin each [T, D/2], computed once per step for all layers."""
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        return cos.contiguous(), sin.contiguous()
