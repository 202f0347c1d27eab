"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged cache, which stores the
compressed latent, not per-head K/V.

Per token x (E features):
    q = q_b(norm(q_a(x)))  (or q_proj(x))                 -> [H, dn + dr]: q_nope | q_pe
    [c | k_pe] = kv_a(x) ;  c = norm(c)                   -> c [r], k_pe [dr] (one "head", shared)
    q_pe, k_pe = rope(q_pe), rope(k_pe)
The cache keeps one row [c | k_pe] (r + dr values) per token: its first half in the K plane and its
second half in the V plane of the engine's paged cache (one kv head of width (r + dr) / 2), so
block management, prefix caching and disaggregated transfer move latents unchanged. Attending,
the context's latents expand: [k_nope | v] = kv_b(c) per head, k = [k_nope | k_pe];
out = o_proj(softmax(scale q.k) v). (Plain expansion, not the absorbed form: simpler, and exact.)
DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...: q_pe and k_pe are de-interleaved first,
which permutes both the same way and leaves every q.k unchanged.

Tensor parallelism is not built (the latent is shared by all heads); the registry refuses it.

Axes: T tokens, E hidden, H heads, r kv_lora_rank, dn/dr/dv nope/rope/value head dims, L keys of a sequence.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from workers.layers.attention_metadata import AttentionMetadata
from workers.layers.context_attention import context_attention
from workers.layers.linear import Linear
from workers.layers.norm import RMSNorm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, N, dr], cos/sin [T, dr/2] -> rotate-half RoPE of x (after de-interleaving if asked)."""
    if interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [x0 x2 .. | x1 x3 ..]
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers)."""
    scale = qk_head_dim**-0.5
    m_all = (rope_scaling or {}).get("mscale_all_dim")
    factor = float((rope_scaling or {}).get("factor") or 1.0)
    if m_all and factor > 1:
        m = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, spec) -> None:  # spec: workers.models.config.ModelSpec
        super().__init__()
        e, h, eps = spec.hidden_size, spec.num_heads, spec.rms_norm_eps
        self.h, self.g = h, 1  # g: kv "heads" of the cache (one latent row)
        self.r, self.dn, self.dr, self.dv = spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.interleaved = spec.rope_interleave
        if spec.q_lora_rank:
            self.q_a_proj = Linear(e, spec.q_lora_rank, spec.attention_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps)
            self.q_b_proj = Linear(spec.q_lora_rank, h * (self.dn + self.dr))
        else:
            self.q_proj = Linear(e, h * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = Linear(e, self.r + self.dr, spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r, eps)
        self.kv_b_proj = Linear(self.r, h * (self.dn + self.dv))
        self.o_proj = Linear(h * self.dv, e, spec.attention_bias)
        self.scale = mla_softmax_scale(self.dn + self.dr, spec.rope_scaling)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0]) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(t, self.h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)  # [T, r], [T, dr]
        c = self.kv_a_layernorm(c.contiguous())[0]
        q = torch.cat([q_nope, rotate(q_pe, cos, sin, self.interleaved)], dim=-1)  # [T, H, dn + dr]
        latent = torch.cat([c, rotate(k_pe[:, None], cos, sin, self.interleaved)[:, 0]], dim=-1)  # [T, r + dr]
        k_plane, v_plane = kv  # [S, 1, (r + dr) / 2] each
        half = k_plane.shape[-1]
        slots = meta.slot_mapping.long()
        k_plane.index_copy_(0, slots, latent[:, None, :half].to(k_plane.dtype))
        v_plane.index_copy_(0, slots, latent[:, None, half:].to(v_plane.dtype))

        def expand(ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # slots [L] -> k [L, H, dn+dr], v [L, H, dv]
            lat = torch.cat([k_plane[ctx, 0], v_plane[ctx, 0]], dim=-1).to(x.dtype)  # [L, r + dr] (cache.kv_cache_dtype may differ)
            n = lat.shape[0]
            k_nope, v = self.kv_b_proj(lat[:, : self.r]).view(n, self.h, self.dn + self.dv).split([self.dn, self.dv], -1)
            k = torch.cat([k_nope, lat[:, None, self.r:].expand(n, self.h, self.dr)], dim=-1)
            return k, v

        o = context_attention(q, expand, meta, self.scale)  # [T, H, dv]
        return self.o_proj(o.reshape(t, self.h * self.dv))
