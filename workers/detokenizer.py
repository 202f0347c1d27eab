"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a multi-byte UTF-8 character spans
tokens) and for SentencePiece (a token's leading space depends on its left neighbour). So each step
decodes a short window: the text of ids[prefix:] minus the text of ids[prefix:read]; the delta is
emitted only once it no longer ends in an incomplete character (U+FFFD), then the window slides.
The window starts on the last few prompt tokens so the first output token gets its spacing right.

Stop strings: the text is searched (only the part the new delta can complete) and cut just before
the earliest stop string. Text that could still be the start of a stop string is held back from
the deltas until it is either completed (and cut) or ruled out, so a streaming client never sees a
piece of a stop string.

Batched: ``add_batch`` adds one token to each of many detokenizers (an engine step's outputs) with
one call of the tokenizer's batched decode (``batch_decoder``) for all their windows instead of two
``decode`` calls per request; the results are the same as ``add`` one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

BatchDecode = Callable[[list[list[int]]], list[str]]  # id windows -> their texts (special tokens skipped)

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first output token


@dataclass(frozen=True)
class DetokenizerState:
    """Everything an ``IncrementalDetokenizer`` carries between tokens (a migrated request's
    detokenizer continues on another worker exactly where it was: same window, held-back text)."""

    ids: list[int]
    prefix_offset: int
    read_offset: int
    text: str
    emitted: int


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.emitted = 0  # chars of text already returned as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token. Returns (text delta safe to emit, stopped on a stop string)."""
        prefix, whole = self.push(token_id)
        return self.advance(self._decode(prefix), self._decode(whole))

    def push(self, token_id: int) -> tuple[list[int], list[int]]:
        """Append a token; -> the two id windows whose texts ``advance`` takes next (the window
        before the token, and with it)."""
        self.ids.append(token_id)
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def advance(self, prefix_text: str, new_text: str) -> tuple[str, bool]:
        """The second half of ``add``, given the decoded texts of ``push``'s windows."""
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return "", False
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop:
            return self.flush(), False
        window_start = max(0, start - self.max_stop_len + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return self.flush(), True
        return self._emit(len(self.text) - self._partial_stop_suffix()), False

    def state(self) -> DetokenizerState:
        return DetokenizerState(list(self.ids), self.prefix_offset, self.read_offset, self.text, self.emitted)

    def restore(self, state: DetokenizerState) -> None:
        """Continue from ``state`` (taken from a detokenizer with the same tokenizer and stop strings)."""
        if not 0 <= state.prefix_offset <= state.read_offset <= len(state.ids) or not 0 <= state.emitted <= len(state.text):
            raise ValueError(f"detokenizer state out of range: offsets {state.prefix_offset}/{state.read_offset} of "
                             f"{len(state.ids)} ids, {state.emitted} of {len(state.text)} chars emitted")
        self.ids, self.prefix_offset, self.read_offset = list(state.ids), state.prefix_offset, state.read_offset
        self.text, self.emitted = state.text, state.emitted

    def flush(self) -> str:
        """Everything not yet emitted (called when the request finishes)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return delta

    def _partial_stop_suffix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


def batch_decoder(tokenizer: Any) -> BatchDecode:
    """``tokenizer``'s batched decode of id windows, equal to ``decode(ids, skip_special_tokens=True)``
    per window: a fast (Rust) tokenizer's own ``decode_batch`` (one call, no Python per window) when
    it does not post-process text (``clean_up_tokenization_spaces`` off); otherwise ``decode`` per
    window (the same result, without the saving)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch") and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                                 True):
        return lambda windows: backend.decode_batch(windows, skip_special_tokens=True)
    return lambda windows: [tokenizer.decode(w, skip_special_tokens=True) for w in windows]


def add_batch(detoks: Sequence[IncrementalDetokenizer], tokens: Sequence[int],
              decode: BatchDecode) -> list[tuple[str, bool]]:
    """``detoks[i].add(tokens[i])`` for every i (distinct detokenizers), with one batched decode."""
    windows = [w for d, t in zip(detoks, tokens, strict=True) for w in d.push(t)]
    texts = decode(windows) if windows else []
    return [d.advance(texts[2 * i], texts[2 * i + 1]) for i, d in enumerate(detoks)]
