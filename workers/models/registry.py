"""model_type (from config.json) -> model class. Add an architecture by adding a line."""

from __future__ import annotations

from torch import nn

from workers.errors import CheckpointError
from workers.models.config import ModelSpec
from workers.models.deepseek import DeepseekForCausalLM
from workers.models.gemma import GemmaForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2_moe import Qwen2MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # q/k/v biases come from ModelSpec.attention_bias
    "mixtral": MixtralForCausalLM,  # sparse MoE MLP, expert parallel over the "ep" group
    "qwen2_moe": Qwen2MoeForCausalLM,  # + shared expert, dense layers, q/k/v biases
    "qwen3": LlamaForCausalLM,  # q/k norms from ModelSpec.qk_norm
    "qwen3_moe": Qwen2MoeForCausalLM,  # q/k norms, no shared expert
    "mistral": LlamaForCausalLM,  # sliding window from ModelSpec.sliding_window
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,  # fused qkv / gate_up in the checkpoint, LongRoPE
    "deepseek_v2": DeepseekForCausalLM,  # MLA + routed and shared experts
    "deepseek_v3": DeepseekForCausalLM,
}


def model_class(spec: ModelSpec) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[spec.model_type]
    except KeyError:
        raise CheckpointError(
            f"model_type {spec.model_type!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
