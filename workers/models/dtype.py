"""``dtype: auto``: the compute dtype of a model from its checkpoint and the device.

auto = the checkpoint's dtype (config.json ``dtype`` / ``torch_dtype``) where the device runs it
well: on CUDA bfloat16 (float16 where the GPU lacks bfloat16), float16 and float32 as stored; on
CPU float32 for every checkpoint (half-precision matmuls on CPU are slow and the kernels here are
fp32; ask for bfloat16 explicitly to get it). Quantized models run float32 activations.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def checkpoint_dtype(path: Path) -> str | None:
    """'float32' | 'bfloat16' | 'float16' as config.json records it, or None if it does not."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    raw = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    return _NAMES.get(str(raw).replace("torch.", "")) if raw else None


def resolve_dtype(requested: str, path: Path, device: str, quantization: str = "none") -> str:
    """The concrete dtype name for ``requested`` ('auto' or a dtype name) on ``device``."""
    if requested != "auto":
        return requested
    stored = checkpoint_dtype(path)
    if quantization != "none" or not device.startswith("cuda") or stored in (None, "float32"):
        chosen = "float32"
    elif stored == "bfloat16" and not torch.cuda.is_bf16_supported():
        chosen = "float16"
    else:
        chosen = stored
    logger.info("dtype auto -> %s (checkpoint %s, device %s)", chosen, stored or "unrecorded", device)
    return chosen
