"""Can this engine serve this checkpoint with this parallel layout? Answered before any worker starts.

``check_support(path, config, parallel)`` reads only the checkpoint's ``config.json`` and runs the
same checks the layers run while they are built (the same functions, so the answers cannot drift):
the architecture is in workers/models/registry.py; ep_size > 1 needs an MoE model whose experts it
divides (workers/parallel/expert_placement.py); tp_size splits the attention heads
(workers/parallel/sharding.py); quantized row-parallel layers split on 32-feature blocks
(workers/layers/quant_parallel.py); lora.enabled needs tp_size, sp_size and ep_size 1 (workers/lora/attach.py). Failures are ``CheckpointError`` (the architecture) or
``ConfigError`` naming the engine key (``tp_size=3: ...``), for the caller to rename to its own key.

Worked example::

    check_support(Path("~/ckpt/gpt2"), EngineConfig(), ParallelConfig())
    # CheckpointError: .../config.json: model_type 'gpt2' is not supported; supported: llama, mixtral, ...
"""

from __future__ import annotations

import json
from pathlib import Path

from workers.config import EngineConfig, ParallelConfig
from workers.errors import CheckpointError, ConfigError
from workers.models.config import ModelSpec
from workers.models.registry import MODEL_REGISTRY


def model_type(path: Path) -> str:
    """``config.json``'s model_type (CheckpointError if it is unreadable or missing)."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json cannot be read ({e}); re-prepare the checkpoint") from None
    kind = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        raise CheckpointError(f"{path}/config.json has no model_type; is it a Hugging Face checkpoint?")
    return kind


def check_support(path: Path, config: EngineConfig, parallel: ParallelConfig) -> ModelSpec:
    """The checkpoint's ModelSpec, once every check of the module docstring passes."""
    kind = model_type(path)
    if kind not in MODEL_REGISTRY:
        raise CheckpointError(f"{path}/config.json: model_type {kind!r} is not supported; supported: "
                              f"{', '.join(sorted(MODEL_REGISTRY))}")
    spec = ModelSpec.from_pretrained(path)
    if parallel.ep_size > 1:
        from workers.parallel.expert_placement import ExpertPlacement

        if spec.num_experts == 0:
            raise ConfigError(f"ep_size={parallel.ep_size}: model_type {kind!r} has no experts to shard; use "
                              "ep_size 1 for dense models")
        ExpertPlacement.contiguous(spec.num_experts, parallel.ep_size)
    if parallel.tp_size > 1:
        _check_tensor_parallel(spec, config.quantization, parallel.tp_size)
    if config.lora.enabled:
        from workers.lora.attach import check_lora_parallel

        check_lora_parallel(config.lora, parallel.tp_size, parallel.sp_size, parallel.ep_size)
    return spec


def _check_tensor_parallel(spec: ModelSpec, quantization: str, tp: int) -> None:
    from workers.layers.quant_parallel import check_row_shard
    from workers.parallel.sharding import attention_shard, even_shard

    for rank in range(tp):
        heads = attention_shard(spec.num_heads, spec.num_kv_heads, tp, rank)
        if quantization == "none":
            continue
        # The quantized row-parallel layers: every layer's o_proj, and the dense MLPs' down_proj.
        check_row_shard(quantization, spec.num_heads * spec.head_dim, spec.hidden_size,
                        heads.q_heads.scaled(spec.head_dim), tp, rank)
        if spec.num_experts == 0 or spec.dense_mlp_layers:
            width = spec.intermediate_size
            check_row_shard(quantization, width, spec.hidden_size, even_shard(width, tp, rank), tp, rank)
