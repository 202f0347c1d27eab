"""A node's record of a checkpoint's tokenizer as transformers built it, so a later start on the node
loads it with the ``tokenizers`` library alone, without importing transformers.

Terms:
    record     ``tokenizer-<key>.json`` in the node's shared-weights directory
               (``EngineConfig.shared_weights_dir``): the Rust tokenizer that
               ``AutoTokenizer.from_pretrained`` built (``backend_tokenizer.to_str()``, padding and
               truncation off) and the few attributes the engine reads. Not tokenizer.json: for some
               families transformers rebuilds the tokenizer from its vocabulary with its own
               pre-tokenizer and added tokens (Qwen2's differs from its tokenizer.json), so reading
               tokenizer.json directly could give other ids.
    key        the checkpoint's tokenizer files (tokenizer*.json, special_tokens_map.json,
               added_tokens.json, vocab / merges, sentencepiece models, chat templates: path, size and
               mtime each, as the weight snapshot's key) and the versions of transformers and
               tokenizers, hashed.

What the engine calls, and why a ``RecordedTokenizer`` answers it exactly as transformers'
``TokenizersBackend`` does (transformers/tokenization_utils_tokenizers.py):
    encode(text)                       the backend's ``encode_batch([text], add_special_tokens=True)``
                                       ids, with ``encode_special_tokens`` = split_special_tokens
    decode(ids, skip_special_tokens)   the backend's ``decode``; transformers would then clean up
                                       spaces only when ``clean_up_tokenization_spaces`` is on, and a
                                       tokenizer with it on is not recorded
    backend_tokenizer, clean_up_tokenization_spaces   the batched decode (workers/detokenizer.py)
    serialized_backend                 llguidance's tokenizer source (workers/structured/grammar.py:
                                       the same string ``llguidance.hf.from_tokenizer`` serializes)
Only a tokenizer whose class keeps transformers' own encode / decode (no family override) is
recorded. Anything else (``apply_chat_template``, ``convert_ids_to_tokens``...) loads transformers'
tokenizer on first use and answers from it (logged once): the result is transformers' own.

Example::

    tok = load_tokenizer(Path("/models/SmolLM2-135M-Instruct"), Path("/var/cache/duet/weights"))
    tok.decode(tok.encode("Hello"), skip_special_tokens=True)   # 'Hello'
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from copy import copy
from importlib import metadata
from pathlib import Path
from typing import Any

from workers.models.shared_weights import files_fingerprint
from workers.models.spec_record import write_atomically

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
                    "chat_template.*")
_ENGINE_METHODS = ("encode", "_encode_plus", "decode", "_decode")  # must be TokenizersBackend's own to record
_ATTRS = ("eos_token_id", "bos_token_id", "pad_token_id", "vocab_size", "split_special_tokens")


def tokenizer_key(path: Path) -> str:
    """The record's key for checkpoint ``path`` (module docstring)."""
    h = hashlib.sha256(metadata.version("transformers").encode())
    h.update(metadata.version("tokenizers").encode())
    files = sorted({f for pattern in _TOKENIZER_FILES for f in path.glob(pattern) if f.is_file()})
    h.update(json.dumps(files_fingerprint(files)).encode())  # stat only: reading tokenizer.json is the cost saved
    return h.hexdigest()[:32]


class RecordedTokenizer:
    """A checkpoint's tokenizer from its record (module docstring); ``path``: the checkpoint, for the
    transformers tokenizer that answers what the record does not hold."""

    def __init__(self, serialized_backend: str, attrs: dict[str, Any], path: Path) -> None:
        from tokenizers import Tokenizer

        self.serialized_backend = serialized_backend
        self.backend_tokenizer = Tokenizer.from_str(serialized_backend)
        self.backend_tokenizer.encode_special_tokens = bool(attrs["split_special_tokens"])
        self.clean_up_tokenization_spaces = False  # recorded only when off
        self.eos_token_id: int | None = attrs["eos_token_id"]
        self.bos_token_id: int | None = attrs["bos_token_id"]
        self.pad_token_id: int | None = attrs["pad_token_id"]
        self.vocab_size: int = attrs["vocab_size"]
        self._len: int = attrs["len"]
        self._path = path
        self._transformers: Any = None
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._len

    def transformers_tokenizer(self) -> Any:
        """transformers' own tokenizer of the checkpoint, loaded on first use."""
        with self._lock:
            if self._transformers is None:
                from transformers import AutoTokenizer  # deferred: what the record saves a start

                logger.info("%s: loading transformers' tokenizer for a call the record does not answer", self._path)
                self._transformers = AutoTokenizer.from_pretrained(self._path)
            return self._transformers

    def __getattr__(self, name: str) -> Any:  # only for attributes not set above
        if name.startswith("__") or name in ("_transformers", "_lock", "_path"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)


def record_of(tokenizer: Any) -> dict[str, Any] | None:
    """The record of a transformers tokenizer, or None where a RecordedTokenizer would not answer as it
    does (a slow tokenizer, space clean-up on, a family's own encode / decode)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not isinstance(tokenizer, TokenizersBackend) or tokenizer.clean_up_tokenization_spaces:
        return None
    if any(getattr(type(tokenizer), m) is not getattr(TokenizersBackend, m) for m in _ENGINE_METHODS):
        return None
    backend = copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer serializes it
    backend.no_padding()
    backend.no_truncation()
    attrs = {a: getattr(tokenizer, a) for a in _ATTRS}
    attrs["len"] = len(tokenizer)
    return {"backend": backend.to_str(), "attrs": attrs}


def load_tokenizer(path: Path, record_dir: Path | None = None) -> Any:
    """The checkpoint's tokenizer: a RecordedTokenizer from the node's record in ``record_dir`` when
    there is one for its key, else transformers' ``AutoTokenizer`` (recorded when it can be). None:
    always transformers', nothing recorded."""
    record = record_dir / f"tokenizer-{tokenizer_key(path)}.json" if record_dir is not None else None
    if record is not None:
        try:
            data = json.loads(record.read_text())
            return RecordedTokenizer(data["backend"], data["attrs"], path)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a torn or foreign file (tokenizers raises its own types): reload
            logger.warning("tokenizer record %s unreadable (%s); loading %s through transformers", record, e, path)
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    tokenizer = AutoTokenizer.from_pretrained(path)
    if record is not None:
        data = record_of(tokenizer)
        if data is None:
            logger.info("%s: %s is not recorded (a later start loads it through transformers too)", path,
                        type(tokenizer).__name__)
        else:
            write_atomically(record, json.dumps(data))
    return tokenizer
