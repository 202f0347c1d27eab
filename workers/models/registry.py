"""model_type (from config.json) -> model class. Add an architecture by adding a line."""

from __future__ import annotations

from torch import nn

from workers.errors import CheckpointError
from workers.models.config import ModelSpec
from workers.models.llama import LlamaForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.qwen2_moe import Qwen2MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # q/k/v biases come from ModelSpec.attention_bias
    "mixtral": MixtralForCausalLM,  # sparse MoE MLP, expert parallel over the "ep" group
    "qwen2_moe": Qwen2MoeForCausalLM,  # + shared expert, dense layers, q/k/v biases
}


def model_class(spec: ModelSpec) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[spec.model_type]
    except KeyError:
        raise CheckpointError(
            f"model_type {spec.model_type!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
