"""Rotary position embedding (RoPE), rotate-half layout as in HF Llama/Qwen2 checkpoints.

For a head vector x = [x1 | x2] (two halves of D/2) at position p with frequencies f (D/2 of them):
    rope(x) = [x1 * cos(p f) - x2 * sin(p f) | x2 * cos(p f) + x1 * sin(p f)]
Supported scalings ('rope_type'): default, linear (positions / factor) and llama3 (Llama 3.1's
frequency-dependent interpolation). Others raise a ConfigError naming the type.

Axes: T tokens, N heads, D head dim.
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
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, D] holding [cos | sin] of the D/2 frequencies.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin each [T, 1, D/2], computed once per step for all layers."""
        cs = self.cos_sin.index_select(0, positions).to(dtype)
        cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> rotated [T, N, D]."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
