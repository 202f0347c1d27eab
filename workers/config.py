"""Engine configuration: frozen dataclasses validated once, at the edge.

Every field error names the field, the value and the limit, so a user can fix a YAML file or a flag
without reading code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from workers.errors import ConfigError

QUANTIZATIONS = ("none", "int8", "q4")  # workers/layers/quant_linear.py
SPEC_METHODS = ("none", "ngram", "draft_model")  # workers/spec_decode/
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


MIN_DRAFT_VOCAB = 256  # a pruned drafter head keeps at least the byte tokens' worth of ids


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (workers/spec_decode/): a proposer drafts tokens, the target verifies
    them all in one forward pass and keeps the longest correct prefix plus one token of its own.

    method: 'none', 'ngram' (prompt lookup: copy what followed the last n tokens' earlier
        occurrence; no model), or 'draft_model' (a small LM with the target's tokenizer in its own
        Ray actor, which Ray may place on a CPU-only node).
    num_speculative_tokens: the most tokens drafted per request per step (k).
    adaptive: pick each request's draft length from its running acceptance rate and the measured
        cost of a draft step vs a verify step (0 = plain decode when drafting does not pay).
    ngram_min / ngram_max: n-gram sizes the prompt-lookup proposer tries, longest first.
    draft_model / draft_quantization: the drafter's checkpoint and weight format.
    drafter_cpus / drafter_resources: what the drafter actor asks Ray for (custom resources place it,
        e.g. {'drafter': 1} on nodes started with that resource).
    draft_timeout_s: a drafter slower than this is dropped for the request (it continues without
        speculation and re-attaches when the drafter answers again).
    overlap: the drafter drafts the next window while the target verifies this one.
    draft_vocab_size: the drafter scores only this many of its tokenizer's most frequent tokens (a
        pruned LM head, workers/spec_decode/draft_vocab.py; output is unchanged); 0 = all.
    drafter_threads: compute threads of the drafter actor; 0 = its drafter_cpus. On a machine where
        target and drafter share the cores, overlap off and both using all cores (time sharing)
        can beat splitting the cores between them (benchmarks/README.md, spec_bench).
    """

    method: str = "none"
    num_speculative_tokens: int = 4
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_quantization: str = "none"
    drafter_cpus: int = 1
    drafter_resources: tuple[tuple[str, float], ...] = ()
    draft_timeout_s: float = 2.0
    overlap: bool = True
    draft_vocab_size: int = 0
    drafter_threads: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.drafter_resources, dict):
            object.__setattr__(self, "drafter_resources", tuple(sorted(self.drafter_resources.items())))
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative.method={self.method!r}: must be one of {', '.join(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"speculative.num_speculative_tokens={self.num_speculative_tokens}: must be in 1..16")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"speculative.ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: "
                              "need 1 <= ngram_min <= ngram_max")
        if self.method == "draft_model" and not self.draft_model:
            raise ConfigError("speculative.method='draft_model' needs speculative.draft_model (a checkpoint dir "
                              "or model name with the target's tokenizer)")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ConfigError(f"speculative.draft_quantization={self.draft_quantization!r}: must be one of "
                              f"{', '.join(QUANTIZATIONS)}")
        if self.drafter_cpus < 1:
            raise ConfigError(f"speculative.drafter_cpus={self.drafter_cpus}: must be >= 1")
        if not self.draft_timeout_s > 0:
            raise ConfigError(f"speculative.draft_timeout_s={self.draft_timeout_s}: must be > 0 seconds")
        if self.draft_vocab_size != 0 and self.draft_vocab_size < MIN_DRAFT_VOCAB:
            raise ConfigError(f"speculative.draft_vocab_size={self.draft_vocab_size}: must be 0 (the full vocabulary) "
                              f"or >= {MIN_DRAFT_VOCAB}, e.g. 32768")
        if self.drafter_threads < 0:
            raise ConfigError(f"speculative.drafter_threads={self.drafter_threads}: must be >= 0 (0 = drafter_cpus)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs.

    model: a local HF checkpoint directory or the alias of an embedded model
        ('SmolLM2-135M-Instruct').
    max_model_len: context limit (prompt + output); None = the model's own limit.
    dtype: 'auto' (default: the checkpoint's dtype where the device supports it, float32 on CPU;
        workers/models/dtype.py), 'float32', 'bfloat16' or 'float16'.
    quantization: weights of the decoder's linear layers: 'none' (dtype), 'int8' (per-output-channel
        scales) or 'q4' (4-bit blocks of 32, GGUF Q4_1 math; a GGUF-sourced model loads its 4-bit
        tensors directly). Quantized layers need dtype float32 activations. See
        workers/layers/quant_linear.py.
    speculative: speculative decoding (see SpeculativeConfig); off by default.
    """

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    quantization: str = "none"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r}: must be one of {', '.join(QUANTIZATIONS)}")
        if self.quantization != "none" and self.dtype not in ("float32", "auto"):
            raise ConfigError(f"quantization={self.quantization!r} with dtype={self.dtype!r}: quantized weights "
                              "run with float32 activations; set dtype to float32 or quantization to none")
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ConfigError(f"dtype={self.dtype!r}: must be auto or one of {sorted(_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 2 (or unset)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device={self.device!r}: must be 'cpu' or 'cuda[:N]'")

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype != "auto", "dtype 'auto' is resolved against the checkpoint first (with_dtype_for)"
        return _DTYPES[self.dtype]

    def with_dtype_for(self, path: Path) -> "EngineConfig":
        """This config with dtype 'auto' resolved for the checkpoint at ``path`` (workers/models/dtype.py)."""
        from workers.models.dtype import resolve_dtype

        return replace(self, dtype=resolve_dtype(self.dtype, path, self.device, self.quantization))
