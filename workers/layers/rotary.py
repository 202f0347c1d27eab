"""Rotary position embedding (RoPE), rotate-half layout as in HF Llama/Qwen2 checkpoints.

For a head vector x = [x1 | x2] (two halves of D/2) at position p with frequencies f (D/2 of them):
    rope(x) = [x1 * cos(p f) - x2 * sin(p f) | x2 * cos(p f) + x1 * sin(p f)]
The rotation itself is applied by ``kernels.rotary_and_cache_write``, fused with the KV-cache
write; this module only builds the per-position [cos | sin] table.

Scalings ('rope_type' of the checkpoint's rope parameters), each as transformers computes it:
  - default; linear (positions / factor); llama3 (Llama 3.1's frequency-dependent interpolation);
  - dynamic (NTK): transformers keeps the default frequencies while the sequence is within
    ``max_position_embeddings`` and the engine never runs past that length (max_model_len is capped
    at it), so inside the engine it equals default;
  - yarn: frequencies blended between interpolated (f / factor) and extrapolated (f) by a linear ramp
    over the dimensions whose wavelength falls between ``beta_fast`` and ``beta_slow`` rotations of
    the original context; cos and sin scaled by the attention factor
    (0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio of DeepSeek);
  - longrope (Phi-3): f_i / short_factor_i for positions below ``original_max_position_embeddings``,
    f_i / long_factor_i from there on, cos and sin scaled by sqrt(1 + ln(s) / ln(original)) with
    s = max_position_embeddings / original. transformers picks one set for a whole forward pass by
    its longest position; the engine picks per position, which is the same while a sequence stays
    within the original length and keeps cached keys valid past it.
Any other type raises a ConfigError naming it and listing these.

Axes: T tokens, D head dim (the rotated part), P positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from workers.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))


def check_rope_scaling(scaling: dict[str, Any] | None, where: str = "rope_scaling") -> None:
    """ConfigError unless the scaling type is one this module builds and its required keys are there."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}.rope_type={rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    required = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(rope_type, ())
    missing = [k for k in required if (scaling or {}).get(k) is None]
    if missing:
        raise ConfigError(f"{where}: rope_type {rope_type!r} needs {', '.join(missing)}")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]


def _yarn(dim: int, theta: float, s: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = int(s.get("original_max_position_embeddings") or max_position)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def corr_dim(rotations: float) -> float:  # the dimension whose wavelength makes `rotations` turns in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv_freq, float(attn)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies [D/2] after the checkpoint's scaling rule (position-independent
    types only; longrope and yarn go through ``rope_table``)."""
    check_rope_scaling(scaling)
    inv_freq = _base_inv_freq(head_dim, theta)
    rope_type = rope_type_of(scaling)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    assert scaling is not None  # every other type comes from a rope_scaling entry
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
    raise ConfigError(f"rope_type {rope_type!r} has position-dependent frequencies; use rope_table")


def rope_table(head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[P, D] holding [cos | sin] of the D/2 frequencies at every position, attention factor applied."""
    check_rope_scaling(scaling)
    rope_type = rope_type_of(scaling)
    positions = torch.arange(max_position, dtype=torch.float32)
    scale = 1.0
    if rope_type == "yarn":
        assert scaling is not None  # yarn and longrope come from a rope_scaling entry
        inv_freq, scale = _yarn(head_dim, theta, scaling, max_position)
        freqs = torch.outer(positions, inv_freq)
    elif rope_type == "longrope":
        assert scaling is not None
        orig = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or max_position / orig
        scale = scaling.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig)))
        base = _base_inv_freq(head_dim, theta)
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != head_dim // 2:
                raise ConfigError(f"rope_scaling.{key}: {len(scaling[key])} values, head_dim/2 = {head_dim // 2}")
        short = base / torch.tensor(scaling["short_factor"], dtype=torch.float32)
        long = base / torch.tensor(scaling["long_factor"], dtype=torch.float32)
        freqs = torch.where((positions < orig)[:, None], torch.outer(positions, short), torch.outer(positions, long))
    else:
        freqs = torch.outer(positions, rope_inv_freq(head_dim, theta, scaling))
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        # [max_position, D] holding [cos | sin] of the D/2 frequencies. A plain attribute, not a
        # buffer: it stays fp32 (like HF) when the model is cast to bf16/fp16. It is created on the
        # device the model is built under (``with torch.device(...)`` in the loader).
        self.cos_sin = rope_table(head_dim, max_position, theta, scaling)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin each [T, D/2], computed once per step for all layers."""
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        return cos.contiguous(), sin.contiguous()
