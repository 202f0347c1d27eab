"""Structured outputs and forced tool calls end to end: the ``openai`` SDK -> the router's HTTP API ->
one real SmolLM2 worker (in this process, no Ray) that constrains every token. Sampled at
temperature 1 with several seeds (n > 1 gives seeds s, s+1, ...), every output parses and validates
with ``jsonschema`` / matches its regex or choice, and forced calls carry arguments valid against
the function's schema."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from testkit.router_fakes import LoopThread, free_port

from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
# Bounded on purpose (maxLength, maxItems, ranges): every sample must fit in max_tokens to be complete.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                 "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
                "required": ["city"], "additionalProperties": False},
}, "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}


@pytest.fixture(scope="module")
def sdk(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    worker = lt.run(start_worker_server(config, worker_id="w0"), timeout=600)  # a first kernel build can be slow
    router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=free_port(),
                                       load_poll_interval_s=0.1), [("w0", worker.endpoint)], tokenizer=tok)
    try:
        with openai.OpenAI(base_url=router.http_url, api_key="x", max_retries=0, timeout=120) as client:
            yield client
    finally:
        router.stop(0)
        lt.run(worker.stop(grace=1))
        lt.close()


def test_json_schema_samples_validate(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=11, n=2, max_tokens=120,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": PERSON,
                                                                     "strict": True}})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert r.choices[0].message.content != r.choices[1].message.content  # two seeds, two samples


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    admin: bool


def test_sdk_parse_with_a_pydantic_model_and_json_object(sdk):
    """The SDK's own structured-output helper (a strict json_schema built from a pydantic model),
    and response_format json_object (on completions, streamed)."""
    r = sdk.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, temperature=1.0, seed=9,
                                   max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, Person)
    chunks = list(sdk.completions.create(model=MODEL, prompt='{"ok": true}\n{"ok": false}\n', temperature=0,
                                         max_tokens=40, stream=True,
                                         extra_body={"response_format": {"type": "json_object"}}))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads("".join(c.choices[0].text for c in chunks)), dict)


def test_regex_and_choice_match(sdk):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}-[0-9]{3}"
    r = sdk.completions.create(model=MODEL, prompt="A code:", temperature=1.0, seed=2, n=2, max_tokens=30,
                               extra_body={"structured_outputs": {"regex": pattern}})
    for c in r.choices:
        assert re.fullmatch(pattern, c.text), c.text
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}],
                                    temperature=1.0, seed=8, n=2, max_tokens=10,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.message.content in ("red", "green", "blue") for c in r.choices)


def test_required_tool_call_validates(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                    tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=100,
                                    parallel_tool_calls=False)  # one call: bounded (the parallel grammar: unit tests)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    [call] = c.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_call_streams_and_validates(sdk):
    chunks = list(sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Berlin?"}], tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=1,
        max_tokens=80))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert {tc.index for tc in calls} == {0}
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in calls)), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_compile_errors_are_400s_naming_the_field(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_grammar": "start: foo("})
    assert e.value.body["param"] == "guided_grammar"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "object", "properties": {
                                            "a": {"type": "string", "format": "no-such-format"}}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
