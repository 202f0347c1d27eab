"""Architecture facts beyond the Llama core, read from a transformers config: attention variants
(sliding window, soft-capping, q/k norms, per-layer RoPE), Gemma's norm convention, multi-head
latent attention and DeepSeek routing. ``ModelSpec.from_pretrained`` merges ``variant_fields``.

Options the engine does not build raise a ConfigError naming the field and what is supported, so a
checkpoint is refused in one line rather than served wrong.
"""

from __future__ import annotations

from typing import Any

from workers.errors import ConfigError
from workers.layers.activation import GATED_ACTIVATIONS
from workers.layers.rotary import check_rope_scaling, rope_type_of

QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
MLA = ("deepseek_v2", "deepseek_v3")


def rope_of(cfg: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of the layers of ``layer_type`` ('full_attention' | 'sliding_attention').
    transformers 5 keeps them in ``rope_parameters`` (per layer type for Gemma 3), 4.x in
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if layer_type in params or "full_attention" in params:  # per layer type
        params = dict(params.get(layer_type) or params.get("full_attention") or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    partial = params.pop("partial_rotary_factor", None) or getattr(cfg, "partial_rotary_factor", None) or 1.0
    if float(partial) != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial}: only 1.0 (RoPE over the whole head) is supported")
    scaling = params or getattr(cfg, "rope_scaling", None)
    if scaling and rope_type_of(scaling) == "default":
        scaling = None
    check_rope_scaling(scaling, "rope_parameters" if getattr(cfg, "rope_parameters", None) else "rope_scaling")
    return float(theta), scaling


def _sliding(cfg: Any) -> dict[str, Any]:
    window = getattr(cfg, "sliding_window", None)
    n = cfg.num_hidden_layers
    if cfg.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        window = None  # the field is there, off unless use_sliding_window
    if not window:
        return {}
    types = getattr(cfg, "layer_types", None)
    layers = tuple(i for i in range(n) if types is None or types[i] == "sliding_attention")
    unknown = sorted(set(types or ()) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported; supported: sliding_attention, full_attention")
    return {"sliding_window": int(window), "sliding_layers": layers}


def _gemma(cfg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"norm_offset": 1.0, "attn_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
                           "attn_logit_softcap": getattr(cfg, "attn_logit_softcapping", None),
                           "final_logit_softcap": getattr(cfg, "final_logit_softcapping", None)}
    if cfg.model_type == "gemma3_text":
        theta, scaling = rope_of(cfg, "sliding_attention")
        out.update(local_rope_theta=getattr(cfg, "rope_local_base_freq", None) or theta, local_rope_scaling=scaling)
    return out


def _mla(cfg: Any) -> dict[str, Any]:
    moe = {"deepseek_v2": {"scoring_func": "softmax", "router_bias": False},
           "deepseek_v3": {"scoring_func": "sigmoid", "router_bias": True}}[cfg.model_type]
    method = getattr(cfg, "topk_method", None)
    grouped = cfg.model_type == "deepseek_v3" or method == "group_limited_greedy"
    # What each family's router computes (as transformers' modeling): V2 softmax, greedy or
    # group-limited; V3 sigmoid + correction bias, group-limited (noaux_tc)
    methods = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}[cfg.model_type]
    if method not in (None, *methods):
        raise ConfigError(f"topk_method={method!r} is not supported for {cfg.model_type}; supported: {', '.join(methods)}")
    scoring = getattr(cfg, "scoring_func", None)
    if scoring not in (None, moe["scoring_func"]):
        raise ConfigError(f"scoring_func={scoring!r} is not supported for {cfg.model_type}; supported: {moe['scoring_func']}")
    if (cfg.kv_lora_rank + cfg.qk_rope_head_dim) % 2:
        raise ConfigError(f"kv_lora_rank + qk_rope_head_dim = {cfg.kv_lora_rank + cfg.qk_rope_head_dim}: "
                          "must be even (the latent cache splits it over the K and V planes)")
    return {"q_lora_rank": cfg.q_lora_rank or 0, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "rope_interleave": cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True)),
            "n_group": (cfg.n_group or 1) if grouped else 1, "topk_group": (cfg.topk_group or 1) if grouped else 1,
            "routed_scaling_factor": float(cfg.routed_scaling_factor), **moe}


def variant_fields(cfg: Any) -> dict[str, Any]:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in GATED_ACTIVATIONS:
        raise ConfigError(f"hidden_act={act!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
    out: dict[str, Any] = {"hidden_act": act, "qk_norm": cfg.model_type in QK_NORM, **_sliding(cfg)}
    if cfg.model_type in GEMMA:
        out.update(_gemma(cfg))
    if cfg.model_type in MLA:
        out.update(_mla(cfg))
    return out
