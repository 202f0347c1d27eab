"""model_type (from config.json) -> model class and what it can run with.

Add an architecture by adding a line to MODEL_REGISTRY and, when it cannot run with some engine
feature, to CAPABILITIES. ``check_supported`` is the fail-fast check the CLI / cluster config runs
before any actor starts: it reads the checkpoint's config (a directory, a config.json path or a
dict) and raises one ``UnsupportedModelError`` (a ConfigError) naming the model, the field and what
is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import CheckpointError, ConfigError
from workers.models.config import ModelSpec
from workers.models.deepseek import DeepseekForCausalLM
from workers.models.gemma import GemmaForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2_moe import Qwen2MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
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


@dataclass(frozen=True)
class Capabilities:
    """Engine features a model can run with. ``why`` explains the refusals."""

    tp: bool = True  # tensor parallel (tp_size > 1)
    sp: bool = True  # sequence parallel (ring attention prefill)
    ep: bool = False  # expert parallel (MoE models only)
    quantization: tuple[str, ...] = ("none", "int8", "q4")
    why: str = ""


_DENSE = Capabilities()
_MOE = Capabilities(ep=True, quantization=("none",), why="the experts' grouped GEMM runs on float weights only")
CAPABILITIES: dict[str, Capabilities] = {
    "mixtral": _MOE, "qwen2_moe": _MOE, "qwen3_moe": _MOE,
    "deepseek_v2": Capabilities(tp=False, sp=False, ep=True, quantization=("none",),
                                why="multi-head latent attention shares one latent over all heads (no tp / sp "
                                    "split built); experts run on float weights"),
}
CAPABILITIES["deepseek_v3"] = CAPABILITIES["deepseek_v2"]
_NO_SP = "sliding-window / soft-capped attention runs the plain context path, which has no ring (sp) variant"


class UnsupportedModelError(ConfigError):
    """The model (or one of its options) cannot run, or cannot run with the requested features."""


def capabilities(spec: ModelSpec) -> Capabilities:
    caps = CAPABILITIES.get(spec.model_type, _DENSE)
    if spec.sliding_layers or spec.attn_logit_softcap is not None:
        caps = Capabilities(caps.tp, False, caps.ep, caps.quantization, caps.why or _NO_SP)
    return caps


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[spec.model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


def _hf_config(config: str | Path | dict[str, Any]) -> Any:
    from transformers import AutoConfig

    if isinstance(config, dict):
        d = dict(config)
        model_type = d.pop("model_type", None)
        if model_type not in MODEL_REGISTRY:
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported; "
                                        f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
        return AutoConfig.for_model(model_type, **d)
    path = Path(config)
    file = path / "config.json" if path.is_dir() else path
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the model config ({e}); point model.name at a checkpoint "
                              "directory with a config.json") from None
    if model_type not in MODEL_REGISTRY:
        raise UnsupportedModelError(f"{file}: model_type {model_type!r} is not supported; "
                                    f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return AutoConfig.from_pretrained(file.parent)


def check_supported(config: str | Path | dict[str, Any], *, name: str | None = None, tp_size: int = 1,
                    sp_size: int = 1, ep_size: int = 1, quantization: str = "none") -> ModelSpec:
    """Raise UnsupportedModelError (one line: model, field, what is supported) unless the model of
    ``config`` (checkpoint dir, config.json path or config dict) runs with these settings; else
    return its spec. Reads only the config, never the weights."""
    label = name or (str(config) if not isinstance(config, dict) else config.get("model_type", "model"))
    try:
        spec = ModelSpec.from_hf_config(_hf_config(config))
        model_class(spec)
    except UnsupportedModelError:
        raise
    except ConfigError as e:
        raise UnsupportedModelError(f"model {label}: {e}") from None
    check_spec(spec, label, tp_size=tp_size, sp_size=sp_size, ep_size=ep_size, quantization=quantization)
    return spec


def check_spec(spec: ModelSpec, label: str, *, tp_size: int = 1, sp_size: int = 1, ep_size: int = 1,
               quantization: str = "none") -> None:
    """The feature half of ``check_supported``, for a spec already read (the loader runs it too)."""
    model_class(spec)
    caps = capabilities(spec)
    t = spec.model_type
    if tp_size > 1 and not caps.tp:
        raise UnsupportedModelError(f"model {label} ({t}): tp_size={tp_size} is not supported (tp_size 1): {caps.why}")
    if sp_size > 1 and not caps.sp:
        raise UnsupportedModelError(f"model {label} ({t}): sp_size={sp_size} is not supported (sp_size 1): {caps.why}")
    if ep_size > 1 and not caps.ep:
        raise UnsupportedModelError(f"model {label} ({t}): ep_size={ep_size} needs a mixture-of-experts model "
                                    f"(supported: {', '.join(k for k, c in CAPABILITIES.items() if c.ep)})")
    if quantization not in caps.quantization:
        raise UnsupportedModelError(f"model {label} ({t}): quantization={quantization!r} is not supported; "
                                    f"supported: {', '.join(caps.quantization)} ({caps.why})")
