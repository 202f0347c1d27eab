"""Gemma 2 and Gemma 3 text decoders: the Llama attention and MLP with Gemma's conventions.

  - embeddings scaled by sqrt(E) (in the model dtype, as transformers does);
  - RMSNorm multiplies by (1 + w) (``norm_offset`` 1: the 1 is added as the weight loads);
  - four norms per layer: x = x + post_attn_norm(attn(in_norm(x))); x = x + post_ff_norm(mlp(pre_ff_norm(x)));
  - GeGLU MLP (gelu_tanh(gate) * up); softmax scale query_pre_attn_scalar^-0.5;
  - alternating sliding-window and full-attention layers (``spec.sliding_layers``);
  - Gemma 2: attention logits soft-capped at 50, final logits at 30 (cap * tanh(s / cap));
  - Gemma 3: q/k RMSNorm per head, and a second RoPE (base 10000, its own scaling) for the sliding layers.

Axes: T tokens, E hidden, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.layers.attention_metadata import AttentionMetadata
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.config import ModelSpec
from workers.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, quant: str, layer_idx: int) -> None:
        super().__init__()
        e, eps = spec.hidden_size, spec.rms_norm_eps
        self.sliding = layer_idx in spec.sliding_layers
        self.input_layernorm = RMSNorm(e, eps, spec.norm_offset)
        self.self_attn = LlamaAttention(spec, quant, layer_idx)
        self.post_attention_layernorm = RMSNorm(e, eps, spec.norm_offset)
        self.pre_feedforward_layernorm = RMSNorm(e, eps, spec.norm_offset)
        self.mlp = LlamaMLP(spec, quant=quant)
        self.post_feedforward_layernorm = RMSNorm(e, eps, spec.norm_offset)

    def forward(self, h: torch.Tensor, cos, sin, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """h [T, E], the residual stream -> the stream after this layer."""
        a = self.self_attn(self.input_layernorm(h)[0], cos, sin, kv, meta)
        x, h = self.pre_feedforward_layernorm(self.post_attention_layernorm(a)[0], h)  # h += norm(a); x = norm(h)
        return h + self.post_feedforward_layernorm(self.mlp(x))[0]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``gemma2``) and Gemma 3 text (``gemma3_text``)."""

    def __init__(self, spec: ModelSpec, quantization: str = "none") -> None:
        super().__init__(spec, quantization)
        self.local_rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                            spec.local_rope_theta or spec.rope_theta,
                                            spec.local_rope_scaling if spec.local_rope_theta else spec.rope_scaling)

    def make_layer(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        return GemmaDecoderLayer(spec, self.quantization, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:  # [T, E]
        h = self.model.embed_tokens(input_ids)  # [T, E]
        h = h * torch.tensor(self.spec.hidden_size**0.5, dtype=h.dtype)
        full = self.model.rotary.lookup(positions, h.dtype)  # cos, sin [T, D/2]
        local = self.local_rotary.lookup(positions, h.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            h = layer(h, *(local if layer.sliding else full), kv, meta)
        return self.model.norm(h)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)  # [N, V], None on tp ranks > 0
        cap = self.spec.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
