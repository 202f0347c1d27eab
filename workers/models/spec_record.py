"""A node's record of a checkpoint's ModelSpec, so a later start on the node reads it without
importing transformers.

Terms:
    record     ``spec-<key>.json`` in the node's shared-weights directory
               (``EngineConfig.shared_weights_dir``, beside the weight snapshots,
               workers/models/shared_weights.py): the ModelSpec that ``ModelSpec.from_pretrained``
               returned for the checkpoint, field by field.
    key        what that spec depends on, hashed: the bytes of config.json and
               generation_config.json, transformers' version (its config classes hold each family's
               defaults and normalise old key spellings) and the source of the code that turns a
               transformers config into a spec (workers/models/config.py, variants.py). A change to
               any of them is a new record; stale ones are never read.

Why: a fresh worker process's first ``AutoConfig.from_pretrained`` imports transformers'
configuration code (1-2 s on this host, more under load) only to fill in defaults; the first
process of a node (the one that publishes the weight snapshot) reads the config through
transformers as before and writes the record, every later one reads the record. The spec is the
same object by construction (tests/workers/models/test_spec_record.py compares every family's).

A record that cannot be written (read-only or full directory) is logged as a WARNING and the spec
read through transformers is used; an unreadable or malformed record is read through transformers
again (and rewritten).

Example::

    spec = read_spec(Path("/models/SmolLM2-135M-Instruct"), Path("/var/cache/duet/weights"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import typing
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from workers.models.config import ModelSpec

logger = logging.getLogger(__name__)

_SPEC_CODE = ("config.py", "variants.py")  # in workers/models/: config -> spec
_CONFIG_FILES = ("config.json", "generation_config.json")


@cache
def _tuple_fields() -> frozenset[str]:
    """ModelSpec's tuple-typed fields (JSON gives them back as lists)."""
    hints = typing.get_type_hints(ModelSpec)
    return frozenset(f.name for f in dataclasses.fields(ModelSpec) if typing.get_origin(hints[f.name]) is tuple)


@cache
def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for name in _SPEC_CODE:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()


def spec_key(path: Path) -> str:
    """The record's key for checkpoint ``path`` (module docstring)."""
    h = hashlib.sha256(_code_fingerprint().encode())
    h.update(metadata.version("transformers").encode())
    for name in _CONFIG_FILES:
        f = path / name
        h.update(name.encode())
        h.update(f.read_bytes() if f.exists() else b"<absent>")
    return h.hexdigest()[:32]


def spec_to_json(spec: ModelSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def spec_from_json(text: str) -> ModelSpec:
    fields: dict[str, Any] = json.loads(text)
    tuples = _tuple_fields()
    values: dict[str, Any] = {k: tuple(v) if k in tuples else v for k, v in fields.items()}
    return ModelSpec(**values)


def record_dir(shared_weights_dir: str | None) -> Path | None:
    """Where a node's start-up records live (this module's spec, workers/models/tokenizer_record.py's
    tokenizer): the node's shared-weights directory (``EngineConfig.shared_weights_dir``); None
    without one (nothing recorded, transformers reads everything)."""
    return Path(shared_weights_dir) if shared_weights_dir else None


def read_spec(path: Path, record_dir: Path | None) -> ModelSpec:
    """The ModelSpec of checkpoint ``path``: from the node's record in ``record_dir`` when there is one
    for its key, else through transformers (``ModelSpec.from_pretrained``), then recorded. None:
    always through transformers, nothing recorded."""
    if record_dir is None:
        return ModelSpec.from_pretrained(path)
    record = record_dir / f"spec-{spec_key(path)}.json"
    try:
        return spec_from_json(record.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as e:  # a torn or foreign file: read it again, rewrite it
        logger.warning("spec record %s unreadable (%s); reading %s/config.json through transformers", record, e, path)
    spec = ModelSpec.from_pretrained(path)
    write_atomically(record, spec_to_json(spec))
    return spec


def write_atomically(record: Path, text: str) -> None:
    """Write ``text`` to ``record`` atomically (a temporary file renamed into place)."""
    tmp = None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=f".{record.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, record)
    except OSError as e:
        logger.warning("cannot write the record %s (%s); later starts read the checkpoint again", record, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)

