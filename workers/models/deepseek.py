"""DeepSeek-V2 / V3: multi-head latent attention (workers/layers/mla.py; the paged cache stores the
latent) and MoE layers of routed plus shared experts, the first ``first_k_dense_replace`` layers dense.

Routing (``DeepseekMoE.select``), per token, s = scores over E experts:
  - V2: s = softmax(x W_g^T); V3: s = sigmoid(x W_g^T), and the choice (not the weights) uses
    s + e_score_correction_bias;
  - group-limited (V2 ``group_limited_greedy``, V3 always): experts form n_group groups; a group's
    score is its best expert's (V2) or the sum of its best two (V3); only the topk_group best
    groups' experts can be picked;
  - weights w = s of the top-k experts, renormalised to sum 1 if norm_topk_prob (V3), times
    routed_scaling_factor.
out = sum_j w_j expert_j(x) + shared(x), shared an ungated SwiGLU MLP of n_shared_experts x the
expert width, replicated on every rank (routed experts are expert-parallel over the "ep" group).

Axes: T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.errors import ConfigError
from workers.layers.moe import SparseMoE
from workers.layers.mla import MLAttention
from workers.layers.rotary import RotaryEmbedding
from workers.models.config import ModelSpec
from workers.models.llama import LlamaDecoderLayer, LlamaMLP
from workers.models.mixtral import MixtralForCausalLM
from workers.parallel.groups import get_group


class DeepseekMoE(SparseMoE):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.num_experts_per_tok,
                         get_group("ep"), spec.norm_topk_prob)
        self.spec = spec
        if spec.num_experts % spec.n_group:
            raise ConfigError(f"n_group={spec.n_group}: must divide n_routed_experts={spec.num_experts}")
        if spec.router_bias:  # checkpoint name: mlp.gate.e_score_correction_bias
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False)
        self.shared_experts = LlamaMLP(spec, spec.shared_expert_intermediate_size) \
            if spec.shared_expert_intermediate_size else None

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E]
        scores = logits.sigmoid() if s.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias.float() if s.router_bias else scores  # type: ignore[operator]  # a Parameter set in __init__
        if s.n_group > 1:
            grouped = choice.view(-1, s.n_group, s.num_experts // s.n_group)  # [T, n_group, E / n_group]
            group_score = grouped.topk(2, dim=-1)[0].sum(-1) if s.router_bias else grouped.max(dim=-1).values
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(s.topk_group, dim=-1)[1], 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(s.num_experts // s.n_group, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1)[1]  # [T, k]
        weights = scores.gather(1, experts)  # [T, k]
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekForCausalLM(MixtralForCausalLM):
    """``deepseek_v2`` and ``deepseek_v3``."""

    _fused = {k: v for k, v in MixtralForCausalLM._fused.items() if v[0] == ".gate_up_proj."}  # MLA keeps q_proj

    def __init__(self, spec: ModelSpec, quantization: str = "none") -> None:
        if get_group("tp").world_size > 1:
            raise ConfigError(f"tp_size={get_group('tp').world_size}: {spec.model_type} (multi-head latent "
                              "attention) runs with tp_size 1; scale it with ep_size instead")
        super().__init__(spec, quantization)
        # RoPE over the dr rotary dims only (spec.head_dim is the cache row width)
        self.model.rotary = RotaryEmbedding(spec.qk_rope_head_dim, spec.max_position_embeddings, spec.rope_theta,
                                            spec.rope_scaling)

    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        return LlamaMLP(spec) if layer_idx in spec.dense_mlp_layers else DeepseekMoE(spec)

    def make_layer(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(spec, self.make_mlp(spec, layer_idx), attn=MLAttention(spec))
