"""GrammarMatcher: one request's position in its grammar, and the token masks it allows.

Terms:
    generated   the request's tokens that the grammar covers: everything from ``output_start``
                (workers/engine/sequence.py) on, so a resumed request's earlier tokens count too.
    sync        the matcher follows the request's live token list: before each mask it consumes
                the generated tokens it has not seen yet. Whatever appended them (this engine's
                sampler, the prefill worker's first token, a router resend, a migration) the
                matcher ends up where plain decoding would have left it: the state is a function
                of the tokens (rebuild by replay, ``rebuild_matcher``). Recompute-preemption does
                not change the tokens, so the matcher survives it as it is.
    mask        a bool row [V]: the tokens the grammar allows next. EOS ids are allowed exactly
                when the grammar is complete (llguidance: accepting state).
    draft masks speculative verification: the mask at the request's state, then after each draft
                token in turn (consumed tentatively, rolled back afterwards), so row i masks the
                target's logits exactly as plain decoding would after drafts 1..i. A draft the
                grammar rejects ends the chain: its row's mask already forbids it, so verification
                stops there and later rows are never used (they repeat the last mask).

The matcher is created lazily from the compiled grammar's template, so a request can be
registered while its grammar still compiles (the engine does not schedule it until ``ready``).

Worked example::

    m = GrammarMatcher(compiler.submit(StructuredOutput("choice", choices=("yes", "no"))))
    m.sync(token_ids, output_start)          # consume what was generated so far
    allowed = m.mask(vocab_size)              # bool [V]
    rows = m.draft_masks([9891], vocab_size)  # bool [2, V]: before and after draft "yes"

Axes: K draft tokens, V vocabulary (the model's logits width), W = ceil(V / 32) mask words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from concurrent.futures import Future

import numpy as np
import torch

from workers.errors import InvalidRequestError
from workers.structured.grammar import CompiledGrammar, result_of
from workers.structured.spec import StructuredOutput


class GrammarError(InvalidRequestError):
    """The grammar cannot go on: no token is allowed, or a token it was given does not fit."""


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 bitmask [..., W] (bit j of word w = token 32w + j) -> bool [..., V]."""
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # [..., 32 W]
    return bits[..., :vocab_size].astype(bool)


class GrammarMatcher:
    """A request's matcher; see the module docstring. Not thread-safe (the engine thread owns it)."""

    def __init__(self, grammar: Future[CompiledGrammar] | CompiledGrammar, spec: StructuredOutput | None = None,
                 timeout_s: float = 10.0) -> None:
        if isinstance(grammar, CompiledGrammar):
            done: Future[CompiledGrammar] = Future()
            done.set_result(grammar)
            spec = grammar.spec
            grammar = done
        assert spec is not None, "a pending grammar needs its spec (for error messages)"
        self.spec = spec
        self._future = grammar
        self._timeout_s = timeout_s
        self._matcher: Any = None  # llguidance.LLMatcher, built on first use
        self._words: np.ndarray | None = None  # int32 [W] scratch row for the mask
        self.num_consumed = 0  # generated tokens consumed so far

    @property
    def field(self) -> str:
        return self.spec.field

    @property
    def future(self) -> Future[CompiledGrammar]:
        return self._future

    @property
    def ready(self) -> bool:
        """The grammar has compiled (or failed: ``matcher()`` then raises)."""
        return self._future.done()

    def check(self) -> None:
        """Raise the compile's InvalidRequestError, if it failed (call once ``ready``)."""
        self._ensure()

    def _ensure(self):
        if self._matcher is None:
            grammar = result_of(self._future, self.spec, self._timeout_s)
            self._matcher = grammar.new_matcher()
            n = (grammar.tokenizer.vocab_size + 31) // 32
            self._words = np.full(n, -1, dtype=np.int32)
        return self._matcher

    # ------------------------------------------------------------------ state
    def sync(self, token_ids: Sequence[int], output_start: int) -> None:
        """Consume the generated tokens (token_ids[output_start:]) not consumed yet."""
        new = token_ids[output_start + self.num_consumed:]
        if new:
            self.advance(new)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume ``tokens``; GrammarError if the grammar does not allow them."""
        m = self._ensure()
        for t in tokens:
            if not m.consume_token(int(t)):
                raise GrammarError(self.field, f"generated token {t} (at output position {self.num_consumed}) "
                                               f"does not fit the grammar: {m.get_error() or 'rejected'}")
            self.num_consumed += 1

    def llmatcher(self):
        """The llguidance matcher (for batched mask calls: workers/sample/grammar_masks.py)."""
        return self._ensure()

    def check_error(self) -> None:
        """GrammarError if the grammar is in its error state."""
        m = self._ensure()
        if m.is_error():
            raise GrammarError(self.field, f"the grammar failed after {self.num_consumed} tokens: {m.get_error()}")

    # ------------------------------------------------------------------ masks
    def mask(self, vocab_size: int) -> np.ndarray:
        """bool [V]: the tokens allowed next. GrammarError when the grammar is in error."""
        m = self._ensure()
        if m.is_error():
            raise GrammarError(self.field, f"the grammar failed after {self.num_consumed} tokens: {m.get_error()}")
        words = self._words
        assert words is not None  # made by _ensure
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)  # drops the GIL
        if m.is_error():
            raise GrammarError(self.field, f"the grammar failed after {self.num_consumed} tokens: {m.get_error()}")
        allowed = unpack_bitmask(words, vocab_size)
        if allowed.shape[0] < vocab_size:  # logits wider than the grammar's vocabulary: padding ids
            allowed = np.concatenate([allowed, np.zeros(vocab_size - allowed.shape[0], dtype=bool)])
        return allowed

    def draft_masks(self, drafts: Sequence[int], vocab_size: int) -> np.ndarray:
        """bool [K + 1, V]: row i is the mask after drafts[:i] (see the module docstring). The
        matcher is back at its state afterwards."""
        rows = [self.mask(vocab_size)]
        m = self._matcher
        consumed = 0
        for t in drafts:
            if not rows[-1][t] or m.is_stopped() or not m.consume_token(int(t)):
                break
            consumed += 1
            rows.append(self.mask(vocab_size))
        if consumed:
            m.rollback(consumed)
        while len(rows) < len(drafts) + 1:
            rows.append(rows[-1])
        return np.stack(rows)

    def is_accepting(self) -> bool:
        return self._ensure().is_accepting()


def rebuild_matcher(grammar: CompiledGrammar, generated_token_ids: Sequence[int]) -> GrammarMatcher:
    """A matcher for ``grammar`` advanced through ``generated_token_ids`` (the request's generated
    tokens so far): how a request moved to another engine (disaggregated decode, migration,
    a resend after a failure) gets its grammar state back. GrammarError if they do not fit."""
    matcher = GrammarMatcher(grammar)
    matcher.advance(generated_token_ids)
    return matcher


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] with -inf where ``allowed`` [N, V] (bool, any device) is False; a new tensor.
    None = no row is constrained (the logits themselves)."""
    if allowed is None:
        return logits
    allowed = allowed.to(logits.device, non_blocking=True)
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
