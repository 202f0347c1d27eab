"""Structured-output fields of the HTTP API -> duet.v1 ``SamplingParams.structured``.

Every form a client may send, and what it becomes (proto ``StructuredOutput`` kind):

    response_format {"type": "text"}                          nothing (free text)
    response_format {"type": "json_object"}                   json_object
    response_format {"type": "json_schema",
                     "json_schema": {"name", "schema", "strict"}}  json_schema (always strict)
    guided_json (object or JSON text)          (vLLM)          json_schema
    guided_regex / guided_choice / guided_grammar (vLLM)       regex / choice / grammar
    structured_outputs {json | regex | choice | grammar |
                        json_object: true}     (vLLM >= 0.10)  the same kinds

Both endpoints take them. At most one may ask for a constraint: two (``response_format`` json
and ``guided_regex``, or two keys of ``structured_outputs``) are a 400 naming both. JSON schemas are
checked here against their metaschema (a 400 naming the field, e.g.
``response_format.json_schema.schema``); what only compiling finds (an unsupported feature, a
regex that does not compile, a grammar error) comes back from the workers' grammar compiler as
INVALID_ARGUMENT naming ``structured.<kind>``, which ``Structured.rename`` turns back into the
field the client sent.

Grammars are llguidance's Lark dialect (see duet.v1 ``StructuredOutput.grammar``), not vLLM's
GBNF. Example::

    spec = from_request(body)          # body.guided_choice = ["yes", "no"]
    spec.field, spec.proto             # "guided_choice", StructuredOutput(choice=ChoiceList(["yes", "no"]))
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from protos.duet.v1 import duet_pb2
from router.http_api.errors import invalid
from router.http_api.schemas import JsonObjectFormat, JsonSchemaFormat, _Sampling


@dataclass(frozen=True)
class Structured:
    """A constraint and the request field it came from (named in errors)."""

    field: str
    proto: duet_pb2.StructuredOutput

    def rename(self, param: str) -> str:
        """An error's ``structured.<kind>...`` param -> the field this constraint came from."""
        if param == "structured" or param.startswith("structured."):
            return self.field
        return param


def from_request(body: _Sampling) -> Structured | None:
    """The one structured-output constraint ``body`` asks for (None for free text); 400 naming
    both fields when it asks for two."""
    found = _sources(body)
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise invalid(second, f"conflicts with {first}: set at most one structured-output constraint "
                              "(response_format, guided_json/regex/choice/grammar, structured_outputs)",
                      code="conflicting_parameters")
    return found[0] if found else None


def _sources(body: _Sampling) -> list[Structured]:
    found: list[Structured] = []
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        found.append(_json_object("response_format"))
    elif isinstance(fmt, JsonSchemaFormat):
        found.append(_json_schema("response_format.json_schema.schema", fmt.json_schema.schema_))
    if body.guided_json is not None:
        found.append(_json_schema("guided_json", body.guided_json))
    if body.guided_regex is not None:
        found.append(_text("guided_regex", "regex", body.guided_regex))
    if body.guided_choice is not None:
        found.append(_choice("guided_choice", body.guided_choice))
    if body.guided_grammar is not None:
        found.append(_text("guided_grammar", "grammar", body.guided_grammar))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(_json_schema("structured_outputs.json", so.json_))
        if so.regex is not None:
            found.append(_text("structured_outputs.regex", "regex", so.regex))
        if so.choice is not None:
            found.append(_choice("structured_outputs.choice", so.choice))
        if so.grammar is not None:
            found.append(_text("structured_outputs.grammar", "grammar", so.grammar))
        if so.json_object:
            found.append(_json_object("structured_outputs.json_object"))
    return found


def _json_object(field: str) -> Structured:
    return Structured(field, duet_pb2.StructuredOutput(json_object=True))


def _json_schema(field: str, schema: dict[str, Any] | str) -> Structured:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise invalid(field, f"not valid JSON ({e}); send a JSON schema object") from None
        if not isinstance(schema, dict):
            raise invalid(field, f"a JSON schema must be an object, got {type(schema).__name__}")
    check_schema(field, schema)
    return Structured(field, duet_pb2.StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False)))


def check_schema(field: str, schema: Any) -> None:
    """400 naming ``field`` unless ``schema`` is a JSON schema (an object valid against the
    metaschema its ``$schema`` names, draft 2020-12 when it names none)."""
    if not isinstance(schema, dict):
        raise invalid(field, f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise invalid(field, f"not a valid JSON schema: {e.message}" + (f" (at {where.lstrip('.')})" if where else "")
                      ) from None


def _text(field: str, kind: str, value: str) -> Structured:
    if not value.strip():
        raise invalid(field, "must be a non-empty string")
    spec: dict[str, Any] = {kind: value}
    return Structured(field, duet_pb2.StructuredOutput(**spec))


def _choice(field: str, choices: list[str]) -> Structured:
    for i, c in enumerate(choices):
        if not c:
            raise invalid(f"{field}[{i}]", "each choice must be a non-empty string")
    return Structured(field, duet_pb2.StructuredOutput(choice=duet_pb2.ChoiceList(choices=choices)))
