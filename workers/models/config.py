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
    # Attention variants (workers/models/variants.py reads these from the checkpoint's config):
    sliding_window: int | None = None  # keys a sliding layer sees (its own position included)
    sliding_layers: tuple[int, ...] = ()  # layers that use the sliding window (all others: full attention)
    attn_scale: float | None = None  # softmax scale of q.k (None: head_dim^-0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (None: rope_theta)
    local_rope_scaling: dict[str, Any] | None = None  # Gemma 3: RoPE scaling of the sliding layers
    hidden_act: str = "silu"  # MLP gate activation: silu | gelu_pytorch_tanh
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q / k head before RoPE
    norm_offset: float = 0.0  # Gemma: RMSNorm multiplies by (offset + stored weight)
    # DeepSeek multi-head latent attention (kv_lora_rank > 0) and its MoE routing:
    q_lora_rank: int = 0  # 0: q_proj is one matrix
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotate (x[2i], x[2i+1]) pairs instead of the two halves
    scoring_func: str = "softmax"  # router scores: softmax | sigmoid
    n_group: int = 1  # group-limited routing: experts in n_group groups, tokens pick topk_group of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # routed experts' output multiplier
    router_bias: bool = False  # DeepSeek-V3: e_score_correction_bias shifts the top-k choice, not the weights

    @property
    def releasable_window(self) -> int | None:
        """The sliding window when *every* layer slides (KV blocks before it can be released,
        workers/engine/scheduler.py); None when some layer attends to the whole context."""
        if self.sliding_window is None or len(set(self.sliding_layers)) < self.num_layers:
            return None
        return self.sliding_window

    @classmethod
    def from_pretrained(cls, path: Path) -> ModelSpec:
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(path)
        except Exception as e:  # any parse failure is a checkpoint problem
            raise CheckpointError(f"{path}/config.json cannot be read ({e}); re-prepare the checkpoint") from e
        from transformers import GenerationConfig

        try:
            return cls.from_hf_config(cfg, _eos_ids(path, cfg, GenerationConfig))
        except AttributeError as e:  # an architecture without a field every supported one has
            raise CheckpointError(f"{path}/config.json: model_type {cfg.model_type!r} has no {e.name!r}; "
                                  "it is not an architecture this engine runs (workers/models/registry.py)") from None

    @classmethod
    def from_hf_config(cls, cfg: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
        """The spec of a transformers config object; ConfigError for an option the engine does not build."""
        from workers.models.variants import rope_of, variant_fields  # imports workers.layers

        theta, scaling = rope_of(cfg, "full_attention")
        num_heads = cfg.num_attention_heads
        fields = dict(
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
            eos_token_ids=eos_token_ids,
        )
        fields.update(_moe_fields(cfg))
        fields.update(variant_fields(cfg))
        if fields.get("kv_lora_rank"):
            # MLA: the paged cache holds one latent row per token ([c_kv | k_pe]), its two halves in
            # the K and V planes: one "kv head" of half the latent width
            fields.update(num_kv_heads=1, head_dim=(fields["kv_lora_rank"] + fields["qk_rope_head_dim"]) // 2)
        return cls(**fields)


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
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        step, only = cfg.decoder_sparse_step, set(cfg.mlp_only_layers or ())
        dense = tuple(i for i in range(cfg.num_hidden_layers)
                      if i in only or cfg.num_experts == 0 or (i + 1) % step != 0)
        return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": bool(cfg.norm_topk_prob),
                "shared_expert_intermediate_size": getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                "dense_mlp_layers": dense}
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):
        # DeepSeek: layers below first_k_dense_replace (and off the moe_layer_freq grid) are dense;
        # n_shared_experts always-on experts form one ungated MLP of n_shared x the expert width
        freq = getattr(cfg, "moe_layer_freq", 1) or 1
        dense = tuple(i for i in range(cfg.num_hidden_layers) if i < cfg.first_k_dense_replace or i % freq != 0)
        return {"num_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "norm_topk_prob": cfg.model_type == "deepseek_v3" and bool(cfg.norm_topk_prob),
                "shared_expert_intermediate_size": (cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
                "dense_mlp_layers": dense}
    return {}
