"""Tool calls through the HTTP server with the ``openai`` SDK, against a fake worker that writes the
Hermes / Qwen2.5 call format (what a model that calls tools writes; the tiny test model will not):
``auto`` turns its text into ``tool_calls`` whole and streamed (same calls, n > 1 per choice), the
tools reach the prompt, a tool conversation round-trips, forced calls send their grammar, and bad
input is a 400 naming the field."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest
from testkit.router_fakes import FakeWorker, FakeWorkerServer, LoopThread, free_port, members, router_config

from router.server import serve_router

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SCRIPT = ('I will look that up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_path, tok):
    lt = LoopThread()
    worker = FakeWorkerServer(lt, FakeWorker("t0", tok.encode(SCRIPT, add_special_tokens=False), tok.eos_token_id))
    worker.start()
    router = serve_router(router_config(smollm2_path, http_port=free_port()), members([worker]), tokenizer=tok)
    try:
        yield router, worker.worker
    finally:
        router.stop(0)
        worker.stop_sync()
        lt.close()


@pytest.fixture
def worker(server):
    server[1].reset()
    return server[1]


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=server[0].http_url, api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://{server[0].http_address}", timeout=30) as client:
        yield client


def _check_calls(calls):
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA)
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "C"}
    assert json.loads(calls[1].function.arguments) == {}


def test_auto_parses_calls_whole(sdk, worker, tok):
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look that up."
    _check_calls(choice.message.tool_calls)
    [sub] = worker.submitted
    prompt = tok.decode(sub.prompt_token_ids)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in prompt and "<tool_call>" in prompt  # the default block
    assert not sub.sampling.HasField("structured")  # auto: nothing is forced


def test_auto_streams_calls_as_openai_does(sdk, worker):
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, stream=True,
                                              n=2, seed=3))
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == index]
        assert finishes[-1] == "tool_calls" and all(f is None for f in finishes[:-1])
        assert "".join(d.content or "" for d in deltas) == "I will look that up."
        starts = [tc for d in deltas for tc in d.tool_calls or () if tc.id is not None]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in starts] == [
            (0, "get_weather", ""), (1, "get_time", "")]
        pieces = [tc for d in deltas for tc in d.tool_calls or () if tc.id is None]
        assert len([p for p in pieces if p.index == 0]) > 1  # the arguments arrive in pieces
        args = {i: "".join(p.function.arguments for p in pieces if p.index == i) for i in (0, 1)}
        assert json.loads(args[0]) == {"city": "Paris", "unit": "C"} and json.loads(args[1]) == {}


def test_parallel_tool_calls_false_keeps_the_first_call(sdk, worker):
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_answers_text_without_tools_in_the_prompt(sdk, worker, tok):
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == SCRIPT  # not parsed
    assert "<tools>" not in tok.decode(worker.submitted[0].prompt_token_ids)


def test_conversation_with_calls_and_results_round_trips(sdk, worker, tok):
    first = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200).choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": out}
               for c, out in zip(first.tool_calls, ["18 C, sunny", "14:05"])]
    r = sdk.chat.completions.create(model=MODEL, messages=[*ASK, first.model_dump(exclude_none=True), *results],
                                    tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    prompt = tok.decode(worker.submitted[-1].prompt_token_ids)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
            in prompt)
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05" in prompt


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_send_a_grammar(sdk, worker, choice):
    sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200)
    grammar = worker.submitted[-1].sampling.structured.grammar
    assert grammar.startswith("start: call\n" if choice != "required" else 'start: call ("\\n" call)*\n')
    assert '{"type": "object", "properties": {"name": {"const": "get_weather"}' in grammar
    assert ('"get_time"' in grammar) == (choice == "required")


def test_structured_fields_reach_the_worker(http, worker):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_choice": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert list(worker.submitted[-1].sampling.structured.choice.choices) == ["a", "b"]


def _error(response, param):
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    return err


@pytest.mark.parametrize("patch, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": 3}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_input_is_a_400_naming_the_field(http, worker, patch, param):
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS, **patch}), param)
    assert not worker.submitted


def test_worker_rejections_name_the_field_the_client_sent(http, worker):
    worker.fail = (grpc.StatusCode.INVALID_ARGUMENT, "sampling.structured.regex: does not compile: unclosed group")
    _error(http.post("/v1/completions", json={"prompt": "x", "guided_regex": "(a"}), "guided_regex")
    worker.fail = (grpc.StatusCode.INVALID_ARGUMENT, "sampling.structured.grammar: unsupported schema keyword")
    err = _error(http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required"}),
                 "tools")
    assert "unsupported schema keyword" in err["message"]
    with http.stream("POST", "/v1/chat/completions", json={"messages": ASK, "guided_choice": ["x"],
                                                            "stream": True}) as r:
        assert r.status_code == 400 and json.loads(r.read())["error"]["param"] == "guided_choice"
