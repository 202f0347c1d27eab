"""Weights shared per node: one read-only snapshot file of a loaded model that every worker of the
node maps, so a second replica loads in milliseconds and the node holds one copy of the weights.

Terms:
    snapshot   a safetensors file with every parameter and buffer of a model *after* loading and
               ``process_weights_after_loading`` (fused q/k/v and gate/up, quantized codes, a tied
               int8 head), so mapping it replaces the whole load. Tensors start on 64-byte
               boundaries: the gaps are padding entries (``__pad__.N``, uint8, skipped), so the file
               stays a valid safetensors file other tools read. Tied tensors (one tensor under several
               names) are stored once; the header's metadata maps the other names to it.
    key        what a snapshot's bytes depend on, hashed into its file name: the checkpoint's files
               (names, sizes, mtimes; the GGUF source's too), dtype, quantization, the rank's place in
               its gang (tp / sp / ep rank and size), the model's tensor layout (names, shapes,
               dtypes) and the source of the code that computes the tensors (workers/models,
               workers/layers, kernels/quant_formats.py) and torch's version. A change to any of
               them is a new snapshot; stale ones are never read (remove old files to reclaim space).
    directory  ``EngineConfig.shared_weights_dir``: node-local (on Kubernetes the chart's node model
               cache, a hostPath volume, so the pods of one node share it; on tmpfs it is shared
               memory).

How a worker loads with a directory set (``SharedWeights.load``), under an exclusive lock per key
(``<key>.lock``, fcntl), so one worker of a node loads while the others wait and then map:
    1. snapshot present and matching the model's layout: map it (mmap MAP_PRIVATE, read-only in
       practice: a write would copy that one page into the writer, never change the file); every
       parameter and buffer becomes a view of the map. No tensor is read or computed.
    2. otherwise: load from the checkpoint as usual (the caller's ``load``), write the snapshot
       (a temporary file renamed into place: a reader never sees half a file), then map it too, so
       the first worker also holds the node's one copy instead of a private one.
On a device other than the CPU the snapshot is copied to the device (a faster load: no
de-quantization or repacking; no sharing, since device memory is per process).

Contract with the models: after ``process_weights_after_loading`` a model's state is its
parameters and buffers (persistent or not). A model that kept state elsewhere would need it
rebuilt after a map; the equivalence tests (tests/workers/models/test_shared_weights.py) compare a
mapped model's tokens with a plainly loaded one for each layer kind.

Failures are never silent: a snapshot that cannot be written (disk full, read-only directory) or
does not match its key's layout is logged as a WARNING and counted (``SharedWeights.counters``);
the worker keeps its own loaded copy.

Example::

    shared = SharedWeights(Path("/var/cache/duet/weights"))
    source = shared.load(model, key_parts, lambda: load_weights_into(model))   # 'mapped' or 'loaded+published'
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 64
PAD = "__pad__."
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_CODE_ROOT = Path(__file__).resolve().parents[2]
_CODE = ("workers/models/*.py", "workers/layers/*.py", "kernels/quant_formats.py")


class SnapshotMismatch(Exception):
    """A snapshot file does not hold the tensors (names, shapes, dtypes) its model expects."""


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name, tied ones under each of their names."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update({n: b for n, b in model.named_buffers(remove_duplicate=False) if b is not None})
    return out


def layout(model: nn.Module) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of every tensor of ``model``, sorted: the model's tensor layout."""
    return sorted((n, list(t.shape), str(t.dtype)) for n, t in model_tensors(model).items())


@cache
def code_fingerprint() -> str:
    """sha256 of the sources that compute a model's loaded tensors, and torch's version."""
    h = hashlib.sha256(torch.__version__.encode())
    for pattern in _CODE:
        for f in sorted(_CODE_ROOT.glob(pattern)):
            h.update(f.relative_to(_CODE_ROOT).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def files_fingerprint(paths: list[Path]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of each file: a replaced checkpoint file changes the key."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return out


def snapshot_key(model: nn.Module, parts: dict[str, Any]) -> str:
    """The snapshot's key (module docstring): ``parts`` (checkpoint files, dtype, quantization,
    ranks...) plus the model's layout and the code fingerprint, hashed."""
    blob = json.dumps({"parts": parts, "layout": layout(model), "code": code_fingerprint()}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def write_snapshot(model: nn.Module, path: Path) -> None:
    """Write ``model``'s tensors to ``path`` atomically (module docstring's format). Raises
    SnapshotMismatch when two tensors overlap in memory without being the same tensor (a view of
    another parameter): mapping them apart would break the aliasing the model relies on."""
    tensors = model_tensors(model)
    canonical: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    storages: dict[int, tuple] = {}
    for name, t in sorted(tensors.items()):
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in canonical:
            aliases[name] = canonical[ident]
            continue
        sp = t.untyped_storage().data_ptr()
        if t.numel() and sp in storages and storages[sp] != ident:
            raise SnapshotMismatch(f"{name} shares memory with another tensor without being it (a view); such a "
                                   "model cannot be mapped from a snapshot")
        storages[sp] = ident
        canonical[ident] = name
    header: dict[str, Any] = {"__metadata__": {"duet_aliases": json.dumps(aliases)}}
    order = sorted(set(canonical.values()))
    offset = 0
    entries: list[tuple[str, torch.Tensor]] = []
    pads = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise SnapshotMismatch(f"{name}: dtype {t.dtype} has no safetensors name")
        if offset % ALIGN:
            gap = ALIGN - offset % ALIGN
            header[f"{PAD}{pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            entries.append((f"{PAD}{pads}", torch.zeros(gap, dtype=torch.uint8)))
            pads += 1
            offset += gap
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        entries.append((name, t))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # data starts 64-byte aligned (safetensors pads headers with spaces)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, t in entries:
                f.write(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                        if t.numel() else b"")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def map_snapshot(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor viewing the file's map, alias -> canonical name). The map is MAP_PRIVATE: the
    page cache's pages, shared by every process mapping the file, until one writes (then that page
    alone is copied into the writer)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, e in header.items():
        if name.startswith(PAD):
            continue
        dtype = _TORCH_DTYPES[e["dtype"]]
        start, end = e["data_offsets"]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start) if count else \
            torch.empty(0, dtype=dtype)
        out[name] = flat.view(e["shape"])
    return out, json.loads(meta.get("duet_aliases", "{}"))


def attach(model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str], device: torch.device) -> None:
    """Point every parameter and buffer of ``model`` at the mapped ``tensors`` (copied to ``device``
    when it is not the CPU). Raises SnapshotMismatch (touching nothing) if a name, shape or dtype differs."""
    wanted = model_tensors(model)
    for name, t in wanted.items():
        got = tensors.get(aliases.get(name, name))
        if got is None or tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
            what = "missing" if got is None else f"{list(got.shape)} {got.dtype}"
            raise SnapshotMismatch(f"{name}: snapshot has {what}, the model expects {list(t.shape)} {t.dtype}")
    placed: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                src = aliases.get(prefix + n, prefix + n)
                p.data = placed.setdefault(src, tensors[src] if device.type == "cpu" else tensors[src].to(device))
        for n, b in mod._buffers.items():
            if b is not None:
                src = aliases.get(prefix + n, prefix + n)
                mod._buffers[n] = placed.setdefault(src, tensors[src] if device.type == "cpu" else tensors[src].to(device))


class SharedWeights:
    """Node-shared snapshots in ``directory`` (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).expanduser()
        self.counters: Counter[str] = Counter()
        self.last_source = ""  # what the last ``load`` did

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"{key}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def load(self, model: nn.Module, key_parts: dict[str, Any], load: Callable[[], None]) -> str:
        """Fill ``model`` (a freshly built, unloaded skeleton) from the node's snapshot, or by
        ``load()`` (loads and processes the weights in place) and then publish it. Returns how:
        'mapped' | 'loaded+published' | 'loaded' (the snapshot could not be written: WARNING)."""
        self.last_source = self._load(model, key_parts, load)
        return self.last_source

    def _load(self, model: nn.Module, key_parts: dict[str, Any], load: Callable[[], None]) -> str:
        device = next((t.device for t in model_tensors(model).values()), torch.device("cpu"))
        key = snapshot_key(model, key_parts)
        path = self.path(key)
        try:
            lock = self._locked(key)
            lock.__enter__()
        except OSError as e:
            self.counters["publish_failed"] += 1
            logger.warning("shared weights: cannot use %s (%s); this worker loads its own copy of the weights (set "
                           "shared_weights_dir to a writable node-local directory)", self.directory, e)
            load()
            return "loaded"
        try:
            if path.is_file():
                try:
                    attach(model, *map_snapshot(path), device)
                    self.counters["mapped"] += 1
                    return "mapped"
                except (SnapshotMismatch, ValueError, KeyError, OSError, struct.error) as e:
                    self.counters["mismatched"] += 1
                    logger.warning("shared weights: snapshot %s is unusable (%s); loading from the checkpoint and "
                                   "writing it again", path, e)
                    path.unlink(missing_ok=True)
            load()
            try:
                write_snapshot(model, path)
                attach(model, *map_snapshot(path), device)
            except (SnapshotMismatch, OSError) as e:
                self.counters["publish_failed"] += 1
                logger.warning("shared weights: could not publish a snapshot to %s (%s); this worker keeps its own "
                               "copy of the weights (set shared_weights_dir to a writable node-local directory)",
                               self.directory, e)
                return "loaded"
            self.counters["published"] += 1
            logger.info("shared weights: wrote %s (%.0f MB) for the other workers of this node", path.name,
                        path.stat().st_size / 1e6)
            return "loaded+published"
        finally:
            lock.__exit__(None, None, None)
