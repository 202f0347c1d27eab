"""Resolve a model name or path to a local Hugging Face safetensors checkpoint directory.

This is the edge where names become paths: ``duet serve``'s worker and drafter actors, the offline
``LLM``, the router (for its tokenizer) and the CLI call ``resolve_model`` before anything is built;
engines then receive the directory (workers/models/checkpoint.py ``checkpoint_dir``).

Example::

    >>> path = resolve_model("SmolLM2-135M-Instruct")   # converts on first use, then cached
    >>> path.name
    'SmolLM2-135M-Instruct'
    >>> resolve_model(str(path)) == path                 # a local checkpoint dir is validated
    True
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.errors import CheckpointError, ModelNotFoundError
from workers.models.assets import hub, qwen
from workers.models.assets.prepare import prepare_gguf_file, prepare_smollm2
from workers.models.checkpoint import CHECKPOINT_HINT, SMOLLM2_ALIASES, validate_checkpoint


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a validated local checkpoint directory for a path or a known model name.

    An existing directory is validated and returned as is; ``SmolLM2-135M-Instruct`` (or
    ``HuggingFaceTB/SmolLM2-135M-Instruct``) is prepared in the cache; a ``.gguf`` file is converted
    once into a cached checkpoint (config and tokenizer from its metadata; ``prepare_gguf_file``);
    any other ``org/name[@revision]`` is a Hugging Face Hub id (workers/models/assets/hub.py). Raises
    ``ModelNotFoundError`` for anything else and ``CheckpointError`` for a broken directory.
    """
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.is_dir():
        validate_checkpoint(path)
        return path
    if raw in SMOLLM2_ALIASES:
        return prepare_smollm2()
    if (canonical := qwen.canonical_name(raw)) is not None:
        return qwen.prepare_qwen(canonical)
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf_file(path)
    if not path.exists() and hub.is_hub_id(raw):
        return hub.resolve_hub(raw)
    if path.exists():
        raise CheckpointError(f"model path {str(path)!r} is a file, not a directory: {CHECKPOINT_HINT}")
    raise ModelNotFoundError(f"model {raw!r} is neither an existing directory nor a known model name: {CHECKPOINT_HINT}")


def prepare_named(name: str, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Prepare a known model by name (SmolLM2 or a Qwen2.5-Coder alias) in ``cache_dir``."""
    if name in SMOLLM2_ALIASES:
        return prepare_smollm2(cache_dir, force=force)
    if (canonical := qwen.canonical_name(name)) is not None:
        return qwen.prepare_qwen(canonical, cache_dir, force=force)
    raise ModelNotFoundError(f"model {name!r} is not a known model name: {CHECKPOINT_HINT}")


def is_known_name(name: str) -> bool:
    """Whether ``prepare_named`` knows ``name`` (SmolLM2 or a Qwen2.5-Coder alias)."""
    return name in SMOLLM2_ALIASES or qwen.canonical_name(name) is not None
