"""Tool calls on /v1/chat/completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> a
ToolPlan (what goes into the prompt, what constrains the output, how the output is parsed).

tool_choice (unset: ``auto`` when there are tools, else ``none``):

    none        the tools are left out of the prompt; the answer is text (content).
    auto        the tools are in the prompt (router/http_api/chat_prompt.py); the model decides.
                Calls it writes in its family's format (router/tool_parsers/, Hermes / Qwen2.5
                ``<tool_call>`` first) come back as ``tool_calls``; other text as content.
    required    the output is grammar-constrained to one or more calls (exactly one with
                ``parallel_tool_calls: false``) in the model's format, each naming one of the tools
                with arguments valid against its ``parameters`` schema.
    {"type": "function", "function": {"name": N}}
                as required, but exactly one call, of N.

A response with calls has ``finish_reason: "tool_calls"`` and each call an id ``call_<24 hex>``
and ``function.arguments`` as JSON text. ``parallel_tool_calls: false`` with ``auto`` keeps only
the first call the model writes.

Bad input (400 naming the field): tool_choice other than none without tools, a tool_choice naming
no tool, two tools of one name, ``parameters`` that is not a JSON schema of an object, and a forced
tool_choice together with a structured-output field (both would constrain the same output).
Example::

    plan = make_plan(body, fmt, structured=None)   # tools=[get_weather], tool_choice="required"
    plan.structured.proto.grammar                  # 'start: call ("\\n" call)*\\ncall: "<tool_call>\\n" %json {...}'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from protos.duet.v1 import duet_pb2
from router.http_api.errors import from_pydantic, invalid
from router.http_api.schemas import ChatCompletionRequest, NamedToolChoice
from router.http_api.structured import Structured, check_schema
from router.tool_parsers import ToolFormat

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """``prompt_tools``: tools (OpenAI JSON) the prompt lists; ``parse``: whether the output is
    parsed for calls; ``structured``: the grammar forcing calls (None unless forced); ``max_calls``:
    how many calls a response keeps (None = all)."""

    choice: str  # none | auto | required | named
    fmt: ToolFormat
    prompt_tools: list[dict[str, Any]]
    parse: bool
    structured: Structured | None
    max_calls: int | None


def make_plan(body: ChatCompletionRequest, fmt: ToolFormat, structured: Structured | None) -> ToolPlan | None:
    """The plan for ``body`` (None: no tools and no tool_choice, a plain chat)."""
    tools = body.tools
    choice = _tool_choice(body.tool_choice)
    if tools is None and choice is None:
        return None
    if tools is not None and not tools:
        raise invalid("tools", "must hold at least one tool (or leave tools out)")
    if not tools:
        if choice != "none":
            raise invalid("tool_choice", f"{_choice_name(choice)!r} needs tools; send tools or leave tool_choice out")
        return ToolPlan("none", fmt, [], False, None, None)
    schemas = _check_tools(tools)
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan("auto", fmt, _as_json(tools), True, None, None if parallel else 1)
    if choice == "none":
        return ToolPlan("none", fmt, [], False, None, None)
    if structured is not None:
        raise invalid("tool_choice", f"{_choice_name(choice)!r} constrains the output to tool calls and conflicts "
                                     f"with {structured.field}; send one of them", code="conflicting_parameters")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise invalid("tool_choice.function.name", f"no tool is named {name!r}; the tools are "
                                                       f"{', '.join(sorted(schemas))}")
        grammar = fmt.forced_grammar([schemas[name]], parallel=False)
        return ToolPlan("named", fmt, _as_json(tools), True, _forced(grammar), 1)
    grammar = fmt.forced_grammar(list(schemas.values()), parallel=parallel)
    return ToolPlan("required", fmt, _as_json(tools), True, _forced(grammar), None if parallel else 1)


def _tool_choice(value: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, str):
        raise invalid("tool_choice", f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                                     f"\"function\": {{\"name\": ...}}}}, got {value!r}")
    try:
        return NamedToolChoice.model_validate(value)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        for err in errors:
            err["loc"] = ("tool_choice", *err.get("loc", ()))
        raise from_pydantic(errors) from None


def _choice_name(choice: Any) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else str(choice)


def _forced(grammar: str) -> Structured:
    # A compile error of this grammar comes from a tool's parameters (e.g. an unsupported schema feature).
    return Structured("tools", duet_pb2.StructuredOutput(grammar=grammar))


def _check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> the JSON schema of one call of that tool ({"name": const, "arguments": parameters})."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in schemas:
            raise invalid(f"tools[{i}].function.name", f"{fn.name!r} names two tools; tool names must be unique")
        params = fn.parameters
        field = f"tools[{i}].function.parameters"
        if params is None:
            params = NO_ARGUMENTS
        else:
            check_schema(field, params)
            kind = params.get("type")
            if kind is not None and kind != "object":
                raise invalid(field, f"must be the JSON schema of an object (\"type\": \"object\"), got type {kind!r}")
        schemas[fn.name] = {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params},
                            "required": ["name", "arguments"], "additionalProperties": False}
    return schemas


def _as_json(tools: list[Any]) -> list[dict[str, Any]]:
    """The tools as OpenAI JSON (what chat templates and system blocks render), unset fields left out."""
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
