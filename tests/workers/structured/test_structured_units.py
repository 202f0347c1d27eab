"""Structured output below the engine: spec validation (errors name the field), proto conversion,
the grammar compiler (errors, LRU cache, shared compiles, time limit), matcher masks (EOS only where
the grammar is complete; draft masks equal step-by-step masks; rollback; rebuild by replay) and
the batched mask helpers (dead ends)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from protos.duet.v1 import duet_pb2
from protos.duet.worker.v1 import worker_pb2
from workers.errors import InvalidRequestError
from workers.sample.penalties import RowContext
from workers.sampling_params import SamplingParams
from workers.structured import grammar as grammar_mod
from workers.structured.convert import spec_from_proto, spec_to_proto
from workers.structured.grammar import GrammarCompiler
from workers.sample.grammar_masks import plain_masks, verify_masks
from workers.structured.matcher import GrammarError, GrammarMatcher, apply_masks, rebuild_matcher, unpack_bitmask
from workers.structured.spec import StructuredOutput

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, len(tokenizer), [EOS], cache_size=4)
    yield c
    c.close()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- spec
@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="xml"), "structured"),
    (dict(kind="regex", value=""), "structured.regex"),
    (dict(kind="grammar", value="   "), "structured.grammar"),
    (dict(kind="json_schema", value="{not json"), "structured.json_schema"),
    (dict(kind="json_schema", value="[1, 2]"), "structured.json_schema"),
    (dict(kind="json_object", value="{}"), "structured.json_object"),
    (dict(kind="choice", choices=()), "structured.choice"),
    (dict(kind="choice", choices=("a", "")), "structured.choice[1]"),
    (dict(kind="regex", value="a", choices=("a",)), "structured.regex"),
    (dict(kind="regex", value="a" * 70_000), "structured.regex"),
])
def test_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput(**kwargs)
    assert e.value.field == field and str(e.value).startswith(field + ": ")


def test_structured_must_be_a_spec():
    with pytest.raises(InvalidRequestError, match="structured"):
        SamplingParams(structured="regex")  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [StructuredOutput("json_object"), StructuredOutput("json_schema", '{"type": "string"}'),
                                  StructuredOutput("regex", "[0-9]+"), StructuredOutput("choice", choices=("a", "b")),
                                  StructuredOutput("grammar", 'start: "x"')])
def test_proto_round_trip(spec):
    for message_type in (duet_pb2.StructuredOutput, worker_pb2.StructuredOutput):
        assert spec_from_proto(spec_to_proto(spec, message_type)) == spec
    assert spec_from_proto(duet_pb2.StructuredOutput()) is None
    with pytest.raises(InvalidRequestError, match="structured.json_object"):
        spec_from_proto(duet_pb2.StructuredOutput(json_object=False))


# ------------------------------------------------------------------------- compiler
@pytest.mark.parametrize("spec, reason", [
    (StructuredOutput("regex", "(("), "unclosed group"),
    (StructuredOutput("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "minLength"),
    (StructuredOutput("json_schema", '{"type": "string", "format": "no-such-format"}'), "no-such-format"),
    (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_compile_errors_name_the_field_and_reason(compiler, spec, reason):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(spec)
    assert e.value.field == spec.field and reason in str(e.value) and "\n" not in str(e.value)


def test_cache_shares_compiles_and_is_bounded(compiler):
    before = compiler.num_compiles
    specs = [StructuredOutput("regex", f"a{{{i}}}") for i in range(1, 7)]
    first = compiler.submit(specs[0])
    assert compiler.submit(specs[0]) is first  # in flight or done: one compile for both requests
    for s in specs:
        compiler.compile(s)
    assert compiler.num_compiles == before + len(specs)
    assert len(compiler._cache) == compiler.cache_size  # LRU bound (4)
    compiler.compile(specs[-1])
    assert compiler.num_compiles == before + len(specs)  # a hit
    compiler.compile(specs[0])  # evicted: compiled again
    assert compiler.num_compiles == before + len(specs) + 1


def test_compile_time_limit_is_an_error_not_a_hang(tokenizer, monkeypatch):
    release = threading.Event()
    real = grammar_mod.compile_grammar

    def slow(spec, tok):
        release.wait(5)
        return real(spec, tok)

    monkeypatch.setattr(grammar_mod, "compile_grammar", slow)
    c = GrammarCompiler(tokenizer, len(tokenizer), [EOS], timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError, match=r"structured.regex: the grammar did not compile within 0.2 s"):
            c.compile(StructuredOutput("regex", "[ab]+"))
        assert time.monotonic() - t0 < 2
    finally:
        release.set()
        c.close()


# -------------------------------------------------------------------------- matcher
def _allowed_ids(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(mask).tolist())


def test_unpack_bitmask_orders_tokens_by_bit():
    words = np.array([0b101, -1 << 31], dtype=np.int32)  # tokens 0, 2 and 63
    assert _allowed_ids(unpack_bitmask(words, 64)) == {0, 2, 63}
    assert unpack_bitmask(words, 40).shape == (40,)


def test_choice_mask_allows_eos_only_when_complete(compiler, tokenizer):
    m = GrammarMatcher(compiler.compile(StructuredOutput("choice", choices=("yes", "no"))))
    V = len(tokenizer)
    first = m.mask(V)
    assert not first[EOS]
    assert all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in _allowed_ids(first))
    m.advance(encode(tokenizer, "yes"))
    assert m.is_accepting() and _allowed_ids(m.mask(V)) == {EOS}
    with pytest.raises(GrammarError, match="structured.choice"):
        m.advance(encode(tokenizer, "x"))


def test_draft_masks_equal_step_by_step_masks_and_roll_back(compiler, tokenizer):
    spec = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}))
    grammar = compiler.compile(spec)
    V = len(tokenizer)
    tokens = encode(tokenizer, '{"a": 12}')
    m = GrammarMatcher(grammar)
    rows = m.draft_masks(tokens, V)
    assert rows.shape == (len(tokens) + 1, V) and m.num_consumed == 0
    step = GrammarMatcher(grammar)
    for i, t in enumerate(tokens):
        assert np.array_equal(rows[i], step.mask(V)) and rows[i][t]
        step.advance([t])
    assert np.array_equal(rows[-1], step.mask(V))
    assert np.array_equal(m.mask(V), rows[0])  # rolled back to where it was
    # a draft the grammar rejects ends the chain: later rows repeat the last mask
    bad = tokens[:2] + encode(tokenizer, "zz") + tokens[2:]
    rows = m.draft_masks(bad, V)
    assert not rows[2][bad[2]] and all(np.array_equal(rows[j], rows[2]) for j in range(3, len(bad) + 1))


def test_rebuild_by_replay_and_sync(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("regex", "[0-9]{2}-[0-9]{2}"))
    done = encode(tokenizer, "12-3")
    rebuilt = rebuild_matcher(grammar, done)
    synced = GrammarMatcher(grammar)
    prompt = [1, 2, 3]
    synced.sync(prompt + done, len(prompt))
    assert synced.num_consumed == rebuilt.num_consumed == len(done)
    assert np.array_equal(synced.mask(len(tokenizer)), rebuilt.mask(len(tokenizer)))
    with pytest.raises(GrammarError, match="structured.regex: generated token"):
        rebuild_matcher(grammar, encode(tokenizer, "ab"))


def test_pending_matcher_waits_for_its_compile(compiler):
    future: Future = Future()
    spec = StructuredOutput("regex", "a+")
    m = GrammarMatcher(future, spec, timeout_s=0.05)
    assert not m.ready
    with pytest.raises(InvalidRequestError, match="did not compile"):
        m.check()
    future.set_result(compiler.compile(spec))
    assert m.ready
    m.check()


# ---------------------------------------------------------------------------- masks
def _row(params: SamplingParams, generated: list[int]) -> RowContext:
    return RowContext(params, [7, 8] + generated, 2, len(generated))


def test_plain_masks_batch_free_and_constrained_rows(compiler, tokenizer):
    V = len(tokenizer)
    grammar = compiler.compile(StructuredOutput("choice", choices=("yes",)))
    free, constrained = SamplingParams(), SamplingParams(structured=grammar.spec)
    allowed, errors = plain_masks([_row(free, []), _row(constrained, [])], [None, GrammarMatcher(grammar)], V,
                                  frozenset({EOS}))
    assert not errors and allowed.shape == (2, V) and allowed[0].all() and 0 < int(allowed[1].sum()) < V
    logits = torch.zeros(2, V)
    masked = apply_masks(logits, allowed)
    assert torch.isfinite(masked[0]).all() and int(torch.isfinite(masked[1]).sum()) == int(allowed[1].sum())
    assert plain_masks([_row(free, [])], [None], V, frozenset({EOS})) == (None, {})


def test_dead_end_is_an_error_and_shortens_drafts(compiler, tokenizer):
    """min_tokens forbids EOS where the grammar allows nothing else: no token may follow."""
    V, eos = len(tokenizer), frozenset({EOS})
    grammar = compiler.compile(StructuredOutput("choice", choices=("yes",)))
    yes = encode(tokenizer, "yes")
    params = SamplingParams(min_tokens=5, max_tokens=8, structured=grammar.spec)
    m = GrammarMatcher(grammar)
    _, errors = plain_masks([_row(params, yes)], [m], V, eos)
    assert "structured.choice: the grammar admits no token after" in str(errors[0]) and "min_tokens" in str(errors[0])
    # verifying drafts that reach the dead end: only drafts before it are verified
    fresh = GrammarMatcher(grammar)
    allowed, keep = verify_masks(_row(params, []), fresh, yes + [EOS], V, eos)
    assert keep == len(yes) - 1 and allowed.shape == (len(yes), V)
    with pytest.raises(GrammarError, match="admits no token"):
        verify_masks(_row(params, yes), m, [EOS], V, eos)


def test_mask_worker_equals_inline_masks(compiler, tokenizer):
    """The engine's background, all-rows-at-once masks equal plain_masks' row-by-row ones."""
    from workers.sample.grammar_masks import MaskWorker, gather_masks

    V, eos = len(tokenizer), frozenset({EOS})
    grammar = compiler.compile(StructuredOutput("json_schema", '{"type": "object", "properties": {"k": {"enum": ["x"]}}}'))
    dead = compiler.compile(StructuredOutput("choice", choices=("yes",)))
    rows = [_row(SamplingParams(structured=grammar.spec), encode(tokenizer, '{"k": ')),
            _row(SamplingParams(), []),
            _row(SamplingParams(structured=grammar.spec), []),
            _row(SamplingParams(min_tokens=9, max_tokens=9, structured=dead.spec), encode(tokenizer, "yes"))]
    fresh = lambda: [GrammarMatcher(grammar), None, GrammarMatcher(grammar), GrammarMatcher(dead)]  # noqa: E731
    want, want_errors = plain_masks(rows, fresh(), V, eos)
    worker = MaskWorker(V, eos, threads=2)
    matchers = fresh()
    ids = ["a", "free", "b", "c"]
    jobs = {rid: (row, m) for rid, row, m in zip(ids, rows, matchers) if m is not None}
    got, got_errors = gather_masks(ids, worker.start(jobs).result(), V)
    worker.close()
    assert torch.equal(got, want) and set(got_errors) == set(want_errors) == {3}
    assert str(got_errors[3]) == str(want_errors[3])
