"""Structured-output and tool fields of the HTTP API, without a server: request JSON -> duet.v1
``SamplingParams.structured`` (every form, both endpoints), conflicts and bad schemas as 400s naming
the field, tool plans, tool prompts through the chat template (SmolLM2's, which knows no tools, and a
Qwen2.5-style one, which does), and the rendering of parsed calls as OpenAI JSON."""

from __future__ import annotations

import json

import grpc
import pytest

from protos.duet.v1 import duet_pb2
from router.http_api import convert, structured
from router.http_api.chat_prompt import ChatPrompt, template_renders_tools
from router.http_api.errors import OpenAIError, from_request_error
from router.http_api.render import Renderer, TokenText
from router.http_api.schemas import ChatCompletionRequest, CompletionRequest
from router.http_api.tool_output import ToolOutput
from router.http_api.tools import make_plan
from router.preprocess import RequestError
from router.tool_parsers import get_format

HERMES = get_format("hermes")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
          "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]

# A Qwen2.5-style template: lists tools in <tools>, writes calls as <tool_call> blocks, tool results as
# <tool_response> in a user turn (the parts of Qwen2.5's template that matter here).
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are Qwen.{% endif %}\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}{%- for c in m.tool_calls %}"
    "\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": USER, **fields}))


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "Answer:", **fields}))


def error_of(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.message.startswith(f"{e.value.param}: "), e.value.body()
    return e.value


# -- structured outputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field, expected", [
    ({"response_format": {"type": "json_object"}}, "response_format", {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     "response_format.json_schema.schema", {"json_schema": SCHEMA}),
    ({"guided_json": SCHEMA}, "guided_json", {"json_schema": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json", {"json_schema": SCHEMA}),
    ({"guided_regex": r"\d{3}-\d{4}"}, "guided_regex", {"regex": r"\d{3}-\d{4}"}),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'start: "a"+'}, "guided_grammar", {"grammar": 'start: "a"+'}),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", {"json_schema": SCHEMA}),
    ({"structured_outputs": {"regex": "[ab]+"}}, "structured_outputs.regex", {"regex": "[ab]+"}),
    ({"structured_outputs": {"choice": ["x"]}}, "structured_outputs.choice", {"choice": ["x"]}),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "structured_outputs.grammar", {"grammar": 'start: "a"'}),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", {"json_object": True}),
])
def test_every_form_maps_to_the_proto_on_both_endpoints(fields, field, expected):
    for body, make in ((chat(**fields), lambda b, s: convert.chat_request(b, "r", 512, None, None, s)),
                       (completion(**fields), lambda b, s: convert.completion_request(b, "r", s))):
        spec = structured.from_request(body)
        assert spec is not None and spec.field == field
        sent = make(body, spec).sampling.structured
        kind = sent.WhichOneof("kind")
        assert list(expected) == [kind]
        value = getattr(sent, kind)
        if kind == "json_schema":
            value = json.loads(value)
        elif kind == "choice":
            value = list(value.choices)
        assert value == expected[kind]


def test_text_format_and_no_fields_constrain_nothing():
    for body in (chat(), chat(response_format={"type": "text"}), completion(structured_outputs={"json_object": False})):
        assert structured.from_request(body) is None
    assert not convert.completion_request(completion(), "r", None).sampling.HasField("structured")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_choice": ["a"], "structured_outputs": {"json": {}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "grammar": 'start: "a"'}}, "structured_outputs.grammar"),
])
def test_two_constraints_are_a_400_naming_both(fields, param):
    e = error_of(structured.from_request, chat(**fields))
    assert e.param == param and e.code == "conflicting_parameters"
    first = next(k for k in ("response_format", "guided_choice", "structured_outputs.regex") if k in e.message)
    assert first != param


@pytest.mark.parametrize("fields, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ({"guided_json": {"properties": {"a": {"minimum": "3"}}}}, "guided_json", "properties.a.minimum"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "must be an object"),
    ({"guided_regex": " "}, "guided_regex", "non-empty"),
    ({"guided_choice": ["a", ""]}, "guided_choice[1]", "non-empty"),
])
def test_bad_specs_are_a_400_naming_the_field(fields, param, reason):
    e = error_of(structured.from_request, completion(**fields))
    assert e.param == param and reason in e.message


def test_worker_errors_name_the_field_the_client_sent():
    spec = structured.from_request(chat(guided_regex="(a"))
    e = from_request_error(RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                        "sampling.structured.regex: does not compile: unclosed group"), spec.rename)
    assert (e.status, e.param, e.message) == (400, "guided_regex", "guided_regex: does not compile: unclosed group")
    other = from_request_error(RequestError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: bad"), spec.rename)
    assert other.param == "top_p"


# -- tool plans ------------------------------------------------------------------------------------

def test_plans_for_each_tool_choice():
    assert make_plan(chat(), HERMES, None) is None
    auto = make_plan(chat(tools=[WEATHER, NOW]), HERMES, None)
    assert (auto.choice, auto.parse, auto.structured, auto.max_calls) == ("auto", True, None, None)
    assert [t["function"]["name"] for t in auto.prompt_tools] == ["get_weather", "now"]
    assert make_plan(chat(tools=[WEATHER], parallel_tool_calls=False), HERMES, None).max_calls == 1
    none = make_plan(chat(tools=[WEATHER], tool_choice="none"), HERMES, None)
    assert (none.prompt_tools, none.parse) == ([], False)
    assert make_plan(chat(tool_choice="none"), HERMES, None).choice == "none"
    required = make_plan(chat(tools=[WEATHER, NOW], tool_choice="required"), HERMES, None)
    assert required.structured.field == "tools" and required.max_calls is None
    assert required.structured.proto.grammar.startswith('start: call ("\\n" call)*')
    assert '"const": "now"' in required.structured.proto.grammar
    named = make_plan(chat(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}),
                      HERMES, None)
    assert named.max_calls == 1 and named.structured.proto.grammar.startswith("start: call\n")
    assert '"const": "now"' in named.structured.proto.grammar and "get_weather" not in named.structured.proto.grammar
    # auto + a format is allowed (the format constrains the text); none + a format too
    assert make_plan(chat(tools=[WEATHER]), HERMES, structured.from_request(chat(guided_regex="a"))).choice == "auto"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tools"),
    ({"tool_choice": "always", "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function"}, "tools": [WEATHER]}, "tool_choice.function"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "required": "city"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(fields, param):
    body = chat(**fields)
    e = error_of(lambda: make_plan(body, HERMES, structured.from_request(body)))
    assert e.param == param


def test_schema_level_errors_come_from_pydantic_with_the_path(http_error=None):
    from pydantic import ValidationError

    from router.http_api.errors import from_pydantic
    for fields, param in (({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                           "tools[0].function.name"),
                          ({"response_format": {"type": "xml"}}, "response_format"),
                          ({"response_format": {"type": "json_schema"}}, "response_format.json_schema")):
        with pytest.raises(ValidationError) as e:
            chat(**fields)
        assert from_pydantic(e.value.errors(include_url=False)).param == param


# -- tool prompts ----------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def _prompt_text(tok, prompt, fields):
    body = chat(**fields)
    plan = make_plan(body, prompt.fmt, None)
    request = convert.chat_request(body, "r", 512, prompt, plan, None)
    assert request.WhichOneof("input") == "prompt_token_ids"
    return tok.decode(request.prompt_token_ids.ids)


def test_smollm2_template_gets_the_default_hermes_block(tok):
    prompt = ChatPrompt(tok)
    assert not template_renders_tools(tok.chat_template) and not prompt.native
    text = _prompt_text(tok, prompt, {"messages": HISTORY, "tools": [WEATHER]})
    system = "<|im_start|>system\nBe brief.\n\n" + HERMES.system_block([WEATHER]) + "<|im_end|>\n"
    calls = (HERMES.render_call("get_weather", {"city": "Paris"}) + "\n"
             + HERMES.render_call("get_weather", {"city": "Rome"}))
    assert text == (system + "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
                    f"<|im_start|>assistant\n{calls}<|im_end|>\n"
                    "<|im_start|>user\n" + HERMES.render_results(["sunny", "rain"]) + "<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # without a system message the block is the system message; tool_choice none leaves it out
    assert _prompt_text(tok, prompt, {"tools": [NOW]}).startswith(
        "<|im_start|>system\n" + HERMES.system_block([NOW]) + "<|im_end|>\n<|im_start|>user\n")
    assert "# Tools" not in _prompt_text(tok, prompt, {"messages": HISTORY, "tools": [NOW], "tool_choice": "none"})


class _WithTemplate:
    """The SmolLM2 tokenizer with another chat template."""

    def __init__(self, tok, template):
        self.tok, self.chat_template = tok, template

    def apply_chat_template(self, conversation, **kwargs):
        return self.tok.apply_chat_template(conversation, chat_template=self.chat_template, **kwargs)

    def encode(self, text, **kwargs):
        return self.tok.encode(text, **kwargs)


def test_tool_capable_template_renders_tools_itself(tok):
    prompt = ChatPrompt(_WithTemplate(tok, QWEN_STYLE))
    assert prompt.native and prompt.fmt is HERMES
    text = _prompt_text(tok, prompt, {"messages": HISTORY, "tools": [WEATHER]})
    assert "<tools>" in text and json.dumps(WEATHER) in text and "Be brief." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert text.count("<tool_response>") == 2 and text.endswith("<|im_start|>assistant\n")


def test_plain_chats_still_go_as_messages_and_bad_history_is_a_400(tok):
    prompt = ChatPrompt(tok)
    assert convert.chat_request(chat(), "r", 512, prompt, None, None).WhichOneof("input") == "messages"
    bad = [*HISTORY[:2], {**HISTORY[2], "tool_calls": [{**HISTORY[2]["tool_calls"][0],
                                                        "function": {"name": "f", "arguments": "[1]"}}]}]
    e = error_of(lambda: convert.chat_request(chat(messages=bad), "r", 512, prompt, None, None))
    assert e.param == "messages[2].tool_calls[0].function.arguments"
    for messages, param in (([{"role": "user", "content": "x", "tool_call_id": "1"}], "messages[0].tool_call_id"),
                            ([{"role": "user", "content": "x", "tool_calls": HISTORY[2]["tool_calls"]}],
                             "messages[0].tool_calls"),
                            ([{"role": "function", "content": "x"}], "messages[0].role")):
        e = error_of(lambda m=messages: convert.chat_request(chat(messages=m), "r", 512, prompt, None, None))
        assert e.param == param


# -- parsed calls as OpenAI JSON -------------------------------------------------------------------

CALLS = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def _stream(text, max_calls=None, size=5):
    out = ToolOutput(HERMES, max_calls)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [out.delta(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return out, deltas


def _accumulate(deltas):
    """What the openai SDK's stream accumulation does: content joined, calls merged by index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", ()):
            slot = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in c:
                assert slot["id"] is None and c["id"].startswith("call_") and c["type"] == "function"
                slot["id"], slot["name"] = c["id"], c["function"]["name"]
            slot["arguments"] += c["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def test_streamed_deltas_equal_the_whole_message():
    out, deltas = _stream(CALLS)
    assert out.called
    content, calls = _accumulate(deltas)
    whole = ToolOutput(HERMES, None).message(CALLS)
    assert content == whole["content"] == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in whole["tool_calls"])


def test_max_calls_and_invalid_blocks():
    _, deltas = _stream(CALLS, max_calls=1)
    assert [c["name"] for c in _accumulate(deltas)[1]] == ["get_weather"]
    assert len(ToolOutput(HERMES, 1).message(CALLS)["tool_calls"]) == 1
    text = "Hi <tool_call>oops</tool_call>"
    assert ToolOutput(HERMES, None).message(text) == {"content": text}
    out, deltas = _stream(text)
    assert _accumulate(deltas) == (text, []) and not out.called
    assert ToolOutput(HERMES, None).message("") == {"content": ""}


def test_renderer_reports_tool_calls_as_the_finish_reason(tok):
    ids = tok.encode(CALLS, add_special_tokens=False)

    def responses():
        return [duet_pb2.GenerateResponse(text=CALLS, token_ids=ids),
                duet_pb2.GenerateResponse(finish_reason=duet_pb2.FINISH_REASON_STOP,
                                          usage=duet_pb2.Usage(prompt_tokens=3, completion_tokens=len(ids)))]

    def renderer():
        return Renderer(chat=True, request_id="x", model="m", token_text=TokenText(tok), logprobs=False,
                        tools=lambda: ToolOutput(HERMES, None))
    whole = renderer()
    for r in responses():
        whole.add(r)
    choice = whole.response()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "now"]
    streamed = renderer()
    chunks = [streamed.chunk(r) for r in responses()]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert _accumulate([c["choices"][0]["delta"] for c in chunks])[0] == "Checking."
    plain = Renderer(chat=True, request_id="x", model="m", token_text=TokenText(tok), logprobs=False,
                     tools=lambda: ToolOutput(HERMES, None))
    plain.add(duet_pb2.GenerateResponse(text="Hello", finish_reason=duet_pb2.FINISH_REASON_STOP))
    assert plain.response()["choices"][0]["finish_reason"] == "stop"
