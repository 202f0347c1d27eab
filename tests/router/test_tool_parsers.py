"""Tool-call formats (router/tool_parsers/): the Hermes / Qwen2.5 ``<tool_call>`` parser, whole and
streamed (any split of the text gives the same calls), its prompt side, and the grammar that forces
calls (compiled by llguidance as the workers do, and checked to accept exactly the valid calls)."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest

from router.tool_parsers import (CallArgs, CallEnd, CallStart, Content, format_for_template, get_format,
                                 register)

HERMES = get_format("hermes")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}

TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"tags": ["a}", {"b": "</tool_call>"}]}}\n</tool_call>\n<tool_call>\n{"arguments": {"city": "Rome"}, '
             '"name": "get_weather"}\n</tool_call>')


def summarise(events):
    """(content, [(name, arguments)], [(raw, valid) of every CallEnd])."""
    content, names, args, ends = [], {}, {}, []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            assert e.index not in names and e.index == len(names)
            names[e.index], args[e.index] = e.name, ""
        elif isinstance(e, CallArgs):
            args[e.index] += e.text
        elif isinstance(e, CallEnd):
            ends.append((e.raw, e.valid))
    return "".join(content), [(names[i], args[i]) for i in sorted(names)], ends


def parse(text, pieces=None):
    s = HERMES.stream()
    events = []
    for p in pieces or [text]:
        events += s.feed(p)
    return summarise(events + s.finish())


def random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_two_calls_with_text_and_tricky_strings():
    content, calls, ends = parse(TWO_CALLS)
    assert content == "Let me check both."
    assert calls == [("get_weather", '{"city": "Paris", "tags": ["a}", {"b": "</tool_call>"}]}'),
                     ("get_weather", '{"city": "Rome"}')]
    assert [v for _, v in ends] == [True, True]
    assert "".join(raw for raw, _ in ends) == TWO_CALLS[len("Let me check both.\n"):].replace(
        "</tool_call>\n<tool_call>", "</tool_call><tool_call>")


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_same_result(seed):
    rng = random.Random(seed)
    text = TWO_CALLS + "\nDone <tool_ca"
    assert parse(text, random_split(text, rng)) == parse(text)
    assert parse(text, list(text)) == parse(text)  # one character at a time


def test_name_streams_before_arguments_complete():
    s = HERMES.stream()
    first = s.feed('ok <tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first[:2] == [Content("ok"), CallStart(0, "get_weather")]
    assert first[2:] == [CallArgs(0, '{"ci')]
    assert s.feed('ty": "Oslo"}  ') == [CallArgs(0, 'ty": "Oslo"}')]  # trailing whitespace is held back
    end = s.feed("}\n</tool_call>")
    assert end == [CallEnd(0, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}  }\n</tool_call>',
                           True)]
    assert s.finish() == []


def test_plain_text_passes_through_exactly():
    text = "No tools needed: 3 < 4 and <b>bold</b> <tool_c\n\n  "
    assert parse(text, list(text))[0] == text
    assert parse(text) == (text, [], [])


def test_arguments_as_a_json_string_and_missing_arguments():
    content, calls, _ = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                              '<tool_call>{"name": "now"}</tool_call>')
    assert content == "" and calls == [("f", '{"a": 1}'), ("now", "{}")]


def test_missing_close_tag_at_end_and_text_right_after_the_object():
    assert parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')[1] == [("f", '{"x": 1}')]
    content, calls, _ = parse('<tool_call>{"name": "f", "arguments": {}} and then some text')
    assert calls == [("f", "{}")] and content == "and then some text"


@pytest.mark.parametrize("block, started", [
    ('<tool_call>\nnot json at all\n</tool_call>', False),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', False),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', True),
])
def test_malformed_blocks_end_invalid_with_their_raw_text(block, started):
    content, calls, ends = parse("before " + block + " after")
    assert ends == [(" " + block, False)]  # with its spacing: content + raw blocks = the text
    assert content == "before after"
    assert (len(calls) == 1) == started


def test_truncated_call_ends_invalid():
    _, calls, ends = parse('<tool_call>\n{"name": "f", "arguments": {"x": ')
    assert calls == [("f", '{"x":')] and ends[0][1] is False


def test_prompt_side_matches_qwen25():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    block = HERMES.system_block(tools)
    assert block.startswith("# Tools\n\nYou may call one or more functions to assist with the user query.")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in block
    assert block.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert HERMES.render_call("f", {"a": 1}) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert parse(HERMES.render_call("f", {"a": 1}))[1] == [("f", '{"a": 1}')]
    assert HERMES.render_results(["1", "2"]) == ("<tool_response>\n1\n</tool_response>\n"
                                                 "<tool_response>\n2\n</tool_response>")


def test_format_detection_and_registry():
    assert format_for_template("{{ messages }}", renders_tools=False) == (HERMES, False)
    assert format_for_template("{% for t in tools %}<tool_call>{% endfor %}", renders_tools=True) == (HERMES, True)
    assert format_for_template("{{ tools }}[TOOL_CALLS]", renders_tools=True) == (HERMES, False)  # unknown: our block
    with pytest.raises(ValueError, match="already registered"):
        register(HERMES)
    with pytest.raises(ValueError, match="unknown tool-call format"):
        get_format("nope")


# -- the forcing grammar, compiled as the workers compile it ---------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(tok):
    return llguidance.hf.from_tokenizer(tok)


def _call_schema(name, params):
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _accepts(grammar, text, tok, ll_tokenizer):
    m = llguidance.LLMatcher(ll_tokenizer, grammar)
    assert not m.is_error(), m.get_error()
    ok = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok and m.is_accepting()


def test_forced_grammar_accepts_valid_calls_only(tok, ll_tokenizer):
    schemas = [_call_schema("get_weather", WEATHER), _call_schema("now", {"type": "object", "properties": {},
                                                                          "additionalProperties": False})]
    one = HERMES.forced_grammar(schemas, parallel=False)
    many = HERMES.forced_grammar(schemas, parallel=True)
    for g in (one, many):
        assert llguidance.LLMatcher.validate_grammar(g, ll_tokenizer) == ""  # no error
    call = HERMES.render_call("get_weather", {"city": "Paris", "days": 2})
    assert _accepts(one, call, tok, ll_tokenizer)
    assert _accepts(many, call + "\n" + HERMES.render_call("now", {}), tok, ll_tokenizer)
    assert not _accepts(one, call + "\n" + call, tok, ll_tokenizer)  # parallel off: one call
    assert not _accepts(one, HERMES.render_call("get_weather", {"days": 2}), tok, ll_tokenizer)  # city required
    assert not _accepts(one, HERMES.render_call("get_weather", {"city": "x", "days": 0}), tok, ll_tokenizer)
    assert not _accepts(one, HERMES.render_call("delete_all", {}), tok, ll_tokenizer)  # not a tool
    assert not _accepts(one, "Sure! " + call, tok, ll_tokenizer)  # no text around the call


def test_forced_grammar_admits_no_free_whitespace(tok, ll_tokenizer):
    """Compact JSON only: a sampled model must not be able to spend max_tokens on whitespace."""
    g = HERMES.forced_grammar([_call_schema("get_weather", WEATHER)], parallel=False)
    call = HERMES.render_call("get_weather", {"city": "Oslo", "days": 3})
    assert _accepts(g, call, tok, ll_tokenizer)
    spaced = call.replace('{"name"', '{\n    "name"', 1)
    assert spaced != call and not _accepts(g, spaced, tok, ll_tokenizer)
