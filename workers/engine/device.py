"""Device and dtype resolution: what a pool's ``device: auto | cpu | cuda`` and ``dtype: auto`` mean
on the node a rank lands on. Pure functions of their inputs (what the config says, how many GPUs
Ray assigned the rank, whether torch sees CUDA, the checkpoint's torch_dtype), so every branch is
tested without a GPU; the rank actor calls them with the node's facts before it builds an engine.

    resolve_device("auto", gpus=1, cuda_available=True)   -> "cuda"
    resolve_device("auto", gpus=0, cuda_available=True)   -> "cpu"     (the pool reserves no GPU)
    resolve_device("auto", gpus=1, cuda_available=False)  -> ConfigError naming the key
    resolve_dtype("auto", "cuda", "bfloat16")             -> "bfloat16" (the checkpoint's)
    resolve_dtype("auto", "cpu", "float32", cpu_bf16=True)   -> "bfloat16" (AVX512-BF16 / AMX CPU)
    resolve_dtype("auto", "cpu", "bfloat16")              -> "float32"  (a CPU without them)
    resolve_dtype("auto", "cpu", None, cpu_bf16=True, quantization="q4") -> "float32" (int8-activation kernels)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from workers.config import DTYPES, EngineConfig
from workers.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str, *, gpus: float, cuda_available: bool, key: str = "device",
                   visible_gpus: int | None = None) -> str:
    """'cpu' or 'cuda' for a rank that Ray gave ``gpus`` GPUs (0 when its pool reserves none).

    auto: cuda when the rank holds GPUs and CUDA is present; a rank holding GPUs on a node without
    CUDA is an error (its pod reserved GPUs the engine could not use). cuda: needs CUDA and, when
    known, at least one visible GPU. A 'cuda:N' index is kept as given."""
    base = requested.split(":")[0]
    if base not in DEVICES or (":" in requested and (base != "cuda" or not requested.split(":")[1].isdigit())):
        raise ConfigError(f"{key}={requested!r}: must be one of auto, cpu, cuda (or cuda:N)")
    if gpus < 0:
        raise ConfigError(f"{key}: a rank cannot hold {gpus} GPUs")
    if base == "cpu":
        return "cpu"
    if not cuda_available:
        if base == "cuda":
            raise ConfigError(f"{key}={requested!r}: this node has no CUDA device (torch.cuda.is_available() is "
                              "False); set device to cpu or auto, or run the pool on GPU nodes")
        if gpus > 0:
            raise ConfigError(f"{key}=auto: the pool reserves {gpus:g} GPU(s) per rank but this node has no CUDA "
                              "device; set gpus_per_rank to 0 or run the pool on GPU nodes")
        return "cpu"
    if visible_gpus is not None and visible_gpus < 1 and (base == "cuda" or gpus > 0):
        raise ConfigError(f"{key}={requested!r}: CUDA is present but no GPU is visible to this rank "
                          "(CUDA_VISIBLE_DEVICES); reserve GPUs with gpus_per_rank")
    if base == "auto":
        return "cuda" if gpus > 0 else "cpu"
    return requested


def resolve_dtype(requested: str, device: str, checkpoint_dtype: str | None, *, key: str = "dtype",
                  quantization: str = "none", cpu_bf16: bool = False) -> str:
    """auto: float32 for quantized weights (their kernels quantize float32 activations to int8); on
    CUDA the checkpoint's torch_dtype (bfloat16 when it names none we run); on CPU bfloat16 when the
    CPU computes bf16 natively (``cpu_bf16``: AVX512-BF16 or AMX, kernels/cpu_features.py), whatever
    the checkpoint records (as vLLM-CPU does: half the bytes per weight, and oneDNN's AMX / AVX512-BF16
    GEMM for batched steps), else float32 (bf16 without those instructions is slower than float32).
    An explicit dtype is kept."""
    if requested == "auto":
        if quantization != "none":
            return "float32"
        if device.startswith("cuda"):
            return checkpoint_dtype if checkpoint_dtype in DTYPES else "bfloat16"
        return "bfloat16" if cpu_bf16 else "float32"
    if requested not in DTYPES:
        raise ConfigError(f"{key}={requested!r}: must be auto or one of {', '.join(DTYPES)}")
    return requested


def check_gpu_count(gpus: float, visible: int, *, key: str = "gpus_per_rank") -> None:
    """A rank asking for more whole GPUs than the node shows is refused at start, naming the key."""
    if gpus > visible:
        raise ConfigError(f"{key}={gpus:g}: this node shows {visible} GPU(s) to the rank; lower {key} or "
                          "schedule the pool on nodes with more GPUs")


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The ``torch_dtype`` (or ``dtype``) a checkpoint's config.json names, if any."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value if isinstance(value, str) else None


def resolve_engine_config(config: EngineConfig, *, gpus: float, cuda_available: bool, visible_gpus: int | None,
                          model_dtype: str | None, cpu_bf16: bool = False) -> EngineConfig:
    """``config`` with device and dtype resolved (re-validated: e.g. cuda_graphs on a device that
    resolved to cpu is refused naming cuda_graphs)."""
    device = resolve_device(config.device, gpus=gpus, cuda_available=cuda_available, visible_gpus=visible_gpus)
    dtype = resolve_dtype(config.dtype, device, model_dtype, quantization=config.quantization, cpu_bf16=cpu_bf16)
    if (device, dtype) == (config.device, config.dtype):
        return config
    return dataclasses.replace(config, device=device, dtype=dtype)


def resolve_for_process(config: EngineConfig, model_dir: Path, gpus: float | None = None) -> EngineConfig:
    """Resolve with this process's facts: ``gpus`` the GPUs Ray assigned this rank (None outside
    Ray: the GPUs torch sees count as held)."""
    if config.resolved and not config.device.startswith("cuda"):
        return config
    import torch

    cuda = torch.cuda.is_available()
    visible = torch.cuda.device_count() if cuda else 0
    held = float(visible) if gpus is None else gpus
    model_dtype = checkpoint_dtype(model_dir) if config.dtype == "auto" else None
    from kernels.cpu_features import fast_bf16

    return resolve_engine_config(config, gpus=held, cuda_available=cuda, visible_gpus=visible, model_dtype=model_dtype,
                                 cpu_bf16=config.dtype == "auto" and fast_bf16())


def resolve_for_rank(config: EngineConfig, gpus: float) -> EngineConfig:
    """A Ray rank's config: resolved against the ``gpus`` GPUs Ray assigned it (the rank actors call
    this before building an engine, so a pool reserving GPUs on a node without CUDA is refused)."""
    from workers.models.checkpoint import checkpoint_dir  # deferred like torch: config checks stay light

    return resolve_for_process(config, checkpoint_dir(config.model), gpus)
