"""Structured output through the router in front of one real SmolLM2 worker (in this process, no
Ray): a JSON schema with n=2 (each choice its own matcher) validates, json_object parses, choice
answers one of the choices, and bad specs are INVALID_ARGUMENT naming the field at the router edge
(the worker never sees them)."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from testkit.router_fakes import LoopThread

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                         "capital": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def stub(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    worker = lt.run(start_worker_server(config, worker_id="w0"), timeout=600)
    router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0,
                                       load_poll_interval_s=0.1), [("w0", worker.endpoint)], tokenizer=tok)
    try:
        with grpc.insecure_channel(router.address) as channel:
            yield duet_pb2_grpc.DuetStub(channel)
    finally:
        router.stop(0)
        lt.run(worker.stop(grace=1))
        lt.close()


def _texts(stub, structured: duet_pb2.StructuredOutput, n: int = 1, **sampling) -> dict[int, tuple[str, int]]:
    request = duet_pb2.GenerateRequest(
        messages=duet_pb2.ChatMessages(messages=[duet_pb2.ChatMessage(role="user", content="Describe Paris as JSON.")]),
        n=n, sampling=duet_pb2.SamplingParams(structured=structured, **sampling))
    out: dict[int, list] = {}
    for r in stub.Generate(request, timeout=120):
        out.setdefault(r.index, []).append(r)
    return {i: ("".join(m.text for m in msgs), msgs[-1].finish_reason) for i, msgs in out.items()}


def test_json_schema_n2_validates(stub):
    choices = _texts(stub, duet_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)), n=2, temperature=1.0, seed=3,
                     max_tokens=48)
    assert sorted(choices) == [0, 1]
    for text, reason in choices.values():
        assert reason == duet_pb2.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_choice(stub):
    [(text, reason)] = _texts(stub, duet_pb2.StructuredOutput(json_object=True), temperature=0.0,
                              max_tokens=64).values()
    assert reason == duet_pb2.FINISH_REASON_STOP and isinstance(json.loads(text), dict)
    [(text, _)] = _texts(stub, duet_pb2.StructuredOutput(choice=duet_pb2.ChoiceList(choices=["sunny", "rainy"])),
                         temperature=1.0, seed=1, max_tokens=8).values()
    assert text in ("sunny", "rainy")


@pytest.mark.parametrize("structured, message", [
    (duet_pb2.StructuredOutput(regex="[a-"), "sampling.structured.regex: "),
    (duet_pb2.StructuredOutput(json_schema='{"type": "string", "minLength": 3, "maxLength": 1}'),
     "sampling.structured.json_schema: "),
    (duet_pb2.StructuredOutput(json_schema="{oops"), "sampling.structured.json_schema: not valid JSON"),
    (duet_pb2.StructuredOutput(grammar="start: nothing_here"), "sampling.structured.grammar: "),
    (duet_pb2.StructuredOutput(choice=duet_pb2.ChoiceList()), "sampling.structured.choice: must hold"),
    (duet_pb2.StructuredOutput(json_object=False), "sampling.structured.json_object: must be true"),
])
def test_bad_specs_are_invalid_argument_naming_the_field(stub, structured, message):
    with pytest.raises(grpc.RpcError) as e:
        _texts(stub, structured, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(message)


def test_ignore_eos_with_structured_is_refused(stub):
    with pytest.raises(grpc.RpcError) as e:
        _texts(stub, duet_pb2.StructuredOutput(json_object=True), ignore_eos=True, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("sampling.ignore_eos")
