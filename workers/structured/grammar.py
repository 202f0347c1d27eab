"""Grammar compiler: StructuredOutput -> a compiled grammar (an llguidance matcher at its start
state), once per distinct spec, off the engine step's critical path.

Why llguidance (https://github.com/guidance-ai/llguidance, pinned 1.9.1) rather than xgrammar:
    * its Rust core computes each step's token mask on the CPU in tens of microseconds with no
      per-grammar precomputation over the vocabulary, so a new schema is usable in about a
      millisecond (xgrammar precomputes a token-mask cache per grammar: fine on a big GPU host,
      a visible stall on the 2-core CPU path that Duet's tests and embedded default run);
    * the mask is a plain int32 bitmask on the host, applied by one tensor op on either device;
    * it has no Python dependencies (xgrammar pulls a torch-version-bound native extension),
      builds straight from the Hugging Face ``tokenizers`` JSON the embedded SmolLM2 ships, and
      supports matcher rollback (speculative decoding) and deep copies (``n`` choices);
    * JSON schema, regex, Lark (and llama.cpp GBNF) grammars through one API, with an explicit
      error for unsupported schema keywords instead of silently ignoring them.

Terms:
    compile       validate the spec and build an ``llguidance.LLMatcher`` at its start state (the
                  template). A request's matcher is a deep copy of the template
                  (workers/structured/matcher.py). Bad specs raise InvalidRequestError naming
                  ``structured.<kind>``.
    cache         an LRU of templates (and of compile errors) keyed by the spec, at most
                  ``cache_size`` entries; concurrent requests for one spec share one compile.
    time limit    llguidance's parser limits bound the work of a compile (lexer fuel, grammar
                  size); a compile still running after ``timeout_s`` fails its requests with an
                  error (the request never hangs waiting for it).

JSON is generated compactly in Python's ``json.dumps`` style (``", "`` between items, ``": "``
after keys, no other whitespace): a model cannot wander off into unbounded whitespace, and every
output parses with ``json.loads``.

Worked example::

    compiler = GrammarCompiler(tokenizer, vocab_size=49152, eos_token_ids=[2])
    grammar = compiler.compile(StructuredOutput("regex", r"\\d{3}"))     # blocking, cached
    future = compiler.submit(StructuredOutput("choice", choices=("yes", "no")))  # on the compile thread
    compiler.compile(StructuredOutput("regex", "(("))  # InvalidRequestError: structured.regex: ...
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from workers.errors import InvalidRequestError
from workers.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
DEFAULT_TIMEOUT_S = 10.0
# JSON in json.dumps' default style; whitespace_flexible False: no whitespace beyond the separators.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A bound on the work one compile may do (llguidance's defaults are 1M fuel / 500k symbols).
PARSER_LIMITS: dict[str, Any] = dict(initial_lexer_fuel=1_000_000, max_grammar_size=500_000, verbose_errors=False)


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled spec: the matcher template (start state) and what built it."""

    spec: StructuredOutput
    template: LLMatcher
    tokenizer: LLTokenizer
    compile_seconds: float

    def new_matcher(self) -> LLMatcher:
        """A fresh matcher at the start state (a deep copy: the template is never advanced)."""
        return self.template.deep_copy()


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar definition of ``spec`` (not validated yet). Raises
    InvalidRequestError for a spec the converters reject outright."""
    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(spec.choices)))
        return llguidance.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise InvalidRequestError(spec.field, str(e)) from None


def compile_grammar(spec: StructuredOutput, tokenizer: LLTokenizer) -> CompiledGrammar:
    """Validate and build ``spec`` (blocking; llguidance drops the GIL while it works)."""
    t0 = time.perf_counter()
    text = grammar_text(spec)
    limits = LLParserLimits(**PARSER_LIMITS)
    error = LLMatcher.validate_grammar(text, tokenizer, limits=limits)
    if error:
        raise InvalidRequestError(spec.field, _reason(error))
    matcher = LLMatcher(tokenizer, text, log_level=0, limits=LLParserLimits(**PARSER_LIMITS))
    if matcher.is_error():
        raise InvalidRequestError(spec.field, _reason(matcher.get_error()))
    return CompiledGrammar(spec, matcher, tokenizer, time.perf_counter() - t0)


def _reason(error: str) -> str:
    """llguidance's message, on one line (it may quote the grammar with a caret underneath)."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    return " / ".join(lines)[:500] or "invalid"


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """An llguidance tokenizer for a Hugging Face fast tokenizer, or a RecordedTokenizer (its
    ``serialized_backend``), about half a second: build once.
    vocab_size: the model's logits width (may exceed the tokenizer's: padded ids are never allowed);
    eos_token_ids: the ids that end generation (allowed exactly where the grammar is complete)."""
    # a node's tokenizer record (workers/models/tokenizer_record.py) holds the very string that
    # llguidance.hf.from_tokenizer serializes from transformers' tokenizer
    source = getattr(hf_tokenizer, "serialized_backend", None)
    if source is not None:
        return LLTokenizer(source, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarCompiler:
    """Compiles specs on one background thread with an LRU cache (see the module docstring)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future[CompiledGrammar]] = OrderedDict()  # guarded by _lock
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiles = 0  # cache misses since start
        self.num_hits = 0

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(self._hf_tokenizer, self.vocab_size, self.eos_token_ids)
            return self._tokenizer

    def submit(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        """The compile of ``spec``: cached (done, or in progress for another request) or started
        now on the compile thread. The future raises InvalidRequestError for a bad spec."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.num_hits += 1
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duet-grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self.num_compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutput, timeout_s: float | None = None) -> CompiledGrammar:
        """Blocking compile (cached), bounded by ``timeout_s`` (default: the compiler's)."""
        return result_of(self.submit(spec), spec, self.timeout_s if timeout_s is None else timeout_s)

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        grammar = compile_grammar(spec, self.tokenizer)
        logger.debug("compiled %s grammar in %.1f ms", spec.kind, grammar.compile_seconds * 1e3)
        return grammar

    def close(self) -> None:
        """Stop the compile thread (compiles in progress finish; idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def result_of(future: Future[CompiledGrammar], spec: StructuredOutput, timeout_s: float) -> CompiledGrammar:
    """The future's grammar; InvalidRequestError when it failed or is still compiling after timeout_s."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        raise InvalidRequestError(spec.field, f"the grammar did not compile within {timeout_s:g} s; "
                                              "simplify the schema / grammar") from None
