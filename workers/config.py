"""Engine configuration: frozen dataclasses validated once, at the edge.

Every field error names the field, the value and the limit, so a user can fix a YAML file or a flag
without reading code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.errors import ConfigError

QUANTIZATIONS = ("none", "int8", "q4")  # workers/layers/quant_linear.py
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    block_size: tokens per KV block.
    kv_cache_memory_bytes: budget for the preallocated block pool (all layers, K and V).
    num_blocks: overrides the budget with an exact block count (tests use tiny pools).
    enable_prefix_caching: reuse full blocks whose content (and whole prefix) match.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"cache.block_size={self.block_size}: must be a power of two >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"cache.kv_cache_memory_bytes={self.kv_cache_memory_bytes}: must be > 0")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"cache.num_blocks={self.num_blocks}: must be >= 2 (or unset)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget continuous batching.

    max_num_batched_tokens: tokens computed per step (decode tokens + prefill chunk tokens).
    max_num_seqs: sequences running at once (default: 64, or the token budget if smaller).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", min(64, max(self.max_num_batched_tokens, 1)))
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1"
            )
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            raise ConfigError(
                f"scheduler.max_num_seqs={self.max_num_seqs}: must be between 1 and "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs.

    model: a local HF checkpoint directory or the alias of an embedded model
        ('SmolLM2-135M-Instruct').
    max_model_len: context limit (prompt + output); None = the model's own limit.
    quantization: weights of the decoder's linear layers: 'none' (dtype), 'int8' (per-output-channel
        scales) or 'q4' (4-bit blocks of 32, GGUF Q4_1 math; a GGUF-sourced model loads its 4-bit
        tensors directly). Quantized layers need dtype float32 activations. See
        workers/layers/quant_linear.py.
    """

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r}: must be one of {', '.join(QUANTIZATIONS)}")
        if self.quantization != "none" and self.dtype != "float32":
            raise ConfigError(f"quantization={self.quantization!r} with dtype={self.dtype!r}: quantized weights "
                              "run with float32 activations; set dtype to float32 or quantization to none")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {sorted(_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 2 (or unset)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device={self.device!r}: must be 'cpu' or 'cuda[:N]'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
