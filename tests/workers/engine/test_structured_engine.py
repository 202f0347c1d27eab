"""Structured output through the engine, with a tiny random model as an adversarial sampler (its
temperature-1 samples are close to uniform over whatever the grammar allows):

- every sampled output (several seeds, temperature 1) of a set of JSON schemas (nested objects,
  arrays with bounds, enums, numbers with ranges, required/optional) parses and validates with
  jsonschema; regex, choice and grammar outputs match;
- constrained and free requests share batches without changing each other's output;
- output is identical across a preemption and across disaggregated prefill/decode (greedy and seeded);
- bad input: a spec that does not compile, a grammar at a dead end and ignore_eos end the request
  with an error naming the field, and nothing leaks (KV blocks, parked requests).
Speculative decoding with grammars: tests/workers/spec_decode/test_spec_structured.py."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from workers.errors import InvalidRequestError
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason
from workers.structured.spec import StructuredOutput

SCHEMAS = {
    "nested_optional": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                    "email": {"type": "string", "maxLength": 12}}},
            "active": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["user", "active"], "additionalProperties": False,
    },
    "arrays_enums": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                                "maxItems": 4},
                       "level": {"enum": ["low", "high", 3, None]}},
        "required": ["tags", "level"], "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                       "n": {"type": "integer", "minimum": 10, "maximum": 99},
                       "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["x", "n", "p"], "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array", "minItems": 2, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False, "required": ["id"],
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 1000}, "ok": {"type": "boolean"}}},
    },
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ("alpha", "beta", "gamma delta")
GRAMMAR = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]/'
PROMPT = [504, 3575, 282, 4649, 314, 253, 1345]
SEEDS = (1, 2, 3)


def parses_with_grammar(text: str) -> bool:
    """GRAMMAR's language, checked by hand: expr = digit | (expr op expr)."""
    def expr(i: int) -> int:
        if i < len(text) and text[i].isdigit():
            return i + 1
        if i < len(text) and text[i] == "(":
            j = expr(i + 1)
            if j < 0 or j >= len(text) or text[j] not in "+*":
                return -1
            k = expr(j + 1)
            return k + 1 if 0 <= k < len(text) and text[k] == ")" else -1
        return -1
    return expr(0) == len(text)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_path: Path) -> LLM:
    return LLM(str(tiny_qwen2_path), kv_cache_memory_bytes=16 << 20, block_size=8, max_num_batched_tokens=256)


def spec_of(name: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))


def check_clean(llm: LLM) -> None:
    stats = llm.engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    assert len(llm.engine.grammars) == 0 and not llm.engine._matchers, "structured state leaked"


def test_sampled_outputs_validate(llm: LLM):
    """json_object (any JSON object) is checked with the real model (tests/router/test_router_structured.py):
    uniform noise inside an unbounded string rarely closes it."""
    cases = [(spec_of(name), name) for name in SCHEMAS]
    cases += [(StructuredOutput("regex", REGEX), "regex"), (StructuredOutput("choice", choices=CHOICES), "choice"),
              (StructuredOutput("grammar", GRAMMAR), "grammar")]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured=spec) for spec, _ in cases for s in SEEDS]
    outs = llm.generate([PROMPT] * len(params), params)
    for (_spec, name), i in zip(cases, range(0, len(outs), len(SEEDS))):
        for out in outs[i: i + len(SEEDS)]:
            assert out.finish_reason is FinishReason.STOP and out.error is None, (name, out.text)
            assert out.token_ids[-1] == llm.engine.spec.eos_token_ids[0]  # ends with EOS: the grammar completed
            text = out.text
            if name in SCHEMAS:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
            elif name == "regex":
                assert re.fullmatch(REGEX, text), text
            elif name == "choice":
                assert text in CHOICES
            else:
                assert parses_with_grammar(text), text
    assert len({o.text for o in outs[:len(SEEDS)]}) > 1  # different seeds, different samples
    check_clean(llm)


def test_constrained_and_free_share_batches(llm: LLM):
    free = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=30, structured=spec_of("arrays_enums")),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured=spec_of("number_ranges"),
                                  top_logprobs=3)]
    alone = [llm.generate([PROMPT], [p])[0] for p in free + constrained]
    mixed = llm.generate([PROMPT] * 4, [free[0], constrained[0], free[1], constrained[1]])
    assert [m.token_ids for m in mixed] == [alone[i].token_ids for i in (0, 2, 1, 3)]
    # the logprobs are of the masked distribution: every alternative with a finite logprob is allowed
    lp = mixed[3].logprobs[0]
    assert lp.token_id == mixed[3].token_ids[0] and lp.top
    assert all(llm.tokenizer.decode([t]).startswith("{") for t, v in lp.top if v > float("-inf"))
    check_clean(llm)


def test_identical_across_preemption(tiny_qwen2_path: Path, llm: LLM):
    """A KV pool too small for the batch preempts (recompute); the matcher follows the tokens."""
    small = LLM(str(tiny_qwen2_path), num_blocks=6, block_size=8, max_num_batched_tokens=64)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=24, structured=spec_of(name))
              for name, t, s in [("array_of_objects", 0.0, None), ("nested_optional", 1.0, 7),
                                 ("array_of_objects", 1.0, 8), ("nested_optional", 1.0, 10)]]
    want = [o.token_ids for o in llm.generate([PROMPT] * len(params), params)]
    got = small.generate([PROMPT] * len(params), params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == want
    check_clean(small)


def test_identical_with_disaggregation(tiny_qwen2_path: Path, llm: LLM):
    """The first token is drawn under the grammar on the prefill side; the decode side's matcher
    replays it (and a resumed request's earlier tokens) before its first mask."""
    prefill = LLM(str(tiny_qwen2_path), kv_cache_memory_bytes=4 << 20, block_size=8).engine
    decode = LLM(str(tiny_qwen2_path), kv_cache_memory_bytes=4 << 20, block_size=8).engine
    params = [SamplingParams(temperature=0.0, max_tokens=50, structured=spec_of("nested_optional")),
              SamplingParams(temperature=1.0, seed=11, max_tokens=50, structured=StructuredOutput("regex", REGEX)),
              SamplingParams(temperature=1.0, seed=12, max_tokens=50, structured=spec_of("array_of_objects"))]
    want = [o.token_ids for o in llm.generate([PROMPT] * len(params), params)]
    got = {}
    tickets = {f"r{i}": decode.reserve(f"r{i}", PROMPT, p) for i, p in enumerate(params)}
    for i, p in enumerate(params):
        prefill.add_request(f"r{i}", PROMPT, p, export_from_block=tickets[f"r{i}"].first_block)
    exports = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            exports[out.request_id] = out.kv_export
    for rid, ex in exports.items():
        got[rid] = list(decode.import_kv(rid, tickets[rid], ex.kv, ex.first_token, ex.generator_state).new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert [got[f"r{i}"] for i in range(len(params))] == want
    # a resend after a failure: prompt + the tokens streamed so far; the matcher replays them
    head = want[0][:7]
    resent = replace(params[0], max_tokens=params[0].max_tokens - len(head))  # what the router sends
    decode.add_request("resent", PROMPT + head, resent, resumed_output_tokens=len(head))
    rest = []
    while decode.has_unfinished():
        for out in decode.step():
            rest += out.new_token_ids
    assert head + rest == want[0]
    for engine in (prefill, decode):
        stats = engine.block_manager.stats()
        assert stats.num_free_blocks == stats.num_blocks and not engine._matchers


@pytest.mark.parametrize("spec, field, reason", [
    (StructuredOutput("regex", "[a-"), "structured.regex", "regex"),
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}'),
     "structured.json_schema", "nope"),
    (StructuredOutput("grammar", "start: missing"), "structured.grammar", "missing"),
])
def test_bad_spec_ends_the_request_with_an_error(llm: LLM, spec, field, reason):
    bad, ok = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=8, structured=spec),
                                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert bad.finish_reason is FinishReason.ABORT and bad.token_ids == []
    assert bad.error.startswith(field + ": ") and reason in bad.error
    assert len(ok.token_ids) == 4  # the other request is unaffected
    check_clean(llm)


def test_dead_end_and_ignore_eos(llm: LLM):
    # the choice is complete after "alpha"; min_tokens forbids EOS there: no token may follow
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, min_tokens=15,
                            structured=StructuredOutput("choice", choices=("alpha",)))
    [out] = llm.generate([PROMPT], [params])
    assert out.finish_reason is FinishReason.ABORT and out.text == "alpha"
    assert out.error.startswith("structured.choice: the grammar admits no token after") and "min_tokens" in out.error
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        llm.generate([PROMPT], [SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))])
    check_clean(llm)


def test_abort_while_compiling_frees_everything(llm: LLM):
    engine = llm.engine
    engine.add_request("slow", PROMPT, SamplingParams(structured=StructuredOutput("regex", "[0-9]{3}x[a-f]{1,9}")))
    assert engine.stats().num_waiting == 1 and engine.has_unfinished()
    final = engine.abort("slow")
    assert final.finish_reason is FinishReason.ABORT and not engine.has_unfinished()
    check_clean(llm)
