"""Qwen2-MoE: Qwen2 attention (q/k/v biases) with, per layer, either routed experts plus an
always-on *shared expert* or (``mlp_only_layers`` / ``decoder_sparse_step``) a dense MLP.

Math of a sparse layer: out = routed(x) + sigmoid(x w_sg) * shared(x), where routed is the top-k MoE
of workers/layers/moe.py (weights renormalised only if ``norm_topk_prob``), shared a SwiGLU MLP of
width ``shared_expert_intermediate_size`` and w_sg [1, H] the shared expert's gate. The shared
expert runs replicated on every rank (like attention); only the routed experts are sharded.

Axes: T tokens, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.layers.linear import Linear
from workers.layers.moe import SparseMoE
from workers.models.config import ModelSpec
from workers.models.llama import LlamaMLP
from workers.models.mixtral import MixtralForCausalLM
from workers.parallel.groups import get_group


class SharedExpertMoE(SparseMoE):
    """Routed experts plus a gated shared expert (parameter names as transformers' Qwen2-MoE)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.num_experts_per_tok,
                         get_group("ep"), spec.norm_topk_prob)
        self.shared_expert = LlamaMLP(spec, spec.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(spec.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routed = super().forward(x)  # [T, H]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        if layer_idx in spec.dense_mlp_layers:
            return LlamaMLP(spec)
        if spec.shared_expert_intermediate_size:
            return SharedExpertMoE(spec)
        return super().make_mlp(spec, layer_idx)
