"""ModelSpec: the architecture facts the engine needs, read once from an HF ``config.json``.

Reading through ``transformers.AutoConfig`` normalises old and new key spellings (``rope_theta`` +
``rope_scaling`` in v4 files, ``rope_parameters`` in v5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import CheckpointError


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # MoE models: routed experts per layer (0 = dense MLP)
    num_experts_per_tok: int = 0  # MoE models: top-k
    moe_intermediate_size: int = 0  # MoE models: expert MLP width (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral does)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: width of the always-on shared expert (0 = none)
    dense_mlp_layers: tuple[int, ...] = ()  # MoE models: layers with a dense MLP instead of experts

    @classmethod
    def from_pretrained(cls, path: Path) -> "ModelSpec":
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - any parse failure is a checkpoint problem
            raise CheckpointError(f"{path}/config.json cannot be read ({e}); re-prepare the checkpoint") from e
        try:
            return cls._from_hf(path, cfg)
        except AttributeError as e:  # an architecture without a field every supported one has
            raise CheckpointError(f"{path}/config.json: model_type {cfg.model_type!r} has no {e.name!r}; "
                                  "it is not an architecture this engine runs (workers/models/registry.py)") from None

    @classmethod
    def _from_hf(cls, path: Path, cfg: Any) -> "ModelSpec":
        from transformers import GenerationConfig

        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", 10000.0)
        scaling = rope or getattr(cfg, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        num_heads = cfg.num_attention_heads
        return cls(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's flag covers q/k/v/o.
            attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
            or bool(getattr(cfg, "qkv_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            eos_token_ids=_eos_ids(path, cfg, GenerationConfig),
            **_moe_fields(cfg),
        )


def _eos_ids(path: Path, cfg: Any, generation_config_cls: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what HF generate() stops on), else config.json."""
    eos: Any = None
    if (path / "generation_config.json").exists():
        eos = generation_config_cls.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _moe_fields(cfg: Any) -> dict[str, Any]:
    """MoE facts: Mixtral names its experts num_local_experts (width intermediate_size, always
    renormalised); Qwen2-MoE num_experts (width moe_intermediate_size, norm_topk_prob, a shared
    expert, and dense layers every decoder_sparse_step-th / in mlp_only_layers)."""
    if cfg.model_type == "mixtral":
        return {"num_experts": cfg.num_local_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.intermediate_size}
    if cfg.model_type == "qwen2_moe":
        step, only = cfg.decoder_sparse_step, set(cfg.mlp_only_layers or ())
        dense = tuple(i for i in range(cfg.num_hidden_layers)
                      if i in only or cfg.num_experts == 0 or (i + 1) % step != 0)
        return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": bool(cfg.norm_topk_prob),
                "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "dense_mlp_layers": dense}
    return {}
