"""Request bodies of the OpenAI-compatible HTTP API (pydantic), following OpenAI's published schemas
for ``POST /v1/chat/completions`` and ``POST /v1/completions``, plus vLLM's common extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
and the structured-output fields ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and ``structured_outputs``).

Validation is strict and closed: a JSON string where a number belongs is a 400 (no coercion), and
a field this API does not implement -- ``functions`` / ``function_call`` (OpenAI's deprecated
predecessors of tools), ``audio``, ``modalities``, image / audio / file content parts, ``echo``,
``suffix``, ``best_of`` > n, and anything unknown -- is a 400 that names it, never silently
ignored. Fields accepted and deliberately without effect: ``user`` (OpenAI's abuse-tracking id), a
message's ``name``, and ``response_format.json_schema.strict`` (schemas are always enforced
strictly). What the structured-output and tool fields mean: router/http_api/structured.py and
router/http_api/tools.py.

Ranges are OpenAI's where it has one (penalties [-2, 2], logit_bias values [-100, 100],
top_logprobs 0..20); ``logprobs`` of completions accepts 0..20 as vLLM does (OpenAI: 0..5). The
router checks the rest (n <= max_n, token ids in the vocabulary, context length) for both APIs.

Example::

    ChatCompletionRequest.model_validate_json(
        '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],'
        ' "max_completion_tokens": 32, "temperature": 0, "logprobs": true, "top_logprobs": 3,'
        ' "response_format": {"type": "json_schema", "json_schema": {"name": "answer",'
        ' "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}')
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]


class _Closed(BaseModel):
    """Unknown fields are errors (400 naming them); no type coercion (strict)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Closed):
    include_usage: bool = False
    # vLLM's extension: usage on every chunk. Not implemented -> only false is accepted.
    continuous_usage_stats: Literal[False] | None = None


NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names
JsonValue = dict[str, Any]


class TextFormat(_Closed):
    type: Literal["text"]


class JsonObjectFormat(_Closed):
    type: Literal["json_object"]


class JsonSchemaSpec(_Closed):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    schema_: JsonValue = Field(alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced strictly


class JsonSchemaFormat(_Closed):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


_FORMAT_TAGS = {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}


def _format_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


# Capitalised tags: error paths leave them out (errors.loc_to_param), so they name the client's fields.
ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("Text")] | Annotated[JsonObjectFormat, Tag("JsonObject")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchema")],
    Discriminator(_format_tag, custom_error_type="invalid_format_type",
                  custom_error_message="type must be one of 'text', 'json_object', 'json_schema'")]


class StructuredOutputs(_Closed):
    """vLLM's ``structured_outputs`` (its newer form of the guided_* fields): set exactly one."""

    json_: JsonValue | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Closed):
    """Fields both endpoints share."""

    model: str | None = None
    n: PosInt | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM: -1 or 0 = off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    min_tokens: NonNegInt | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None  # accepted, no effect
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    # Structured output (router/http_api/structured.py): at most one of these is set.
    response_format: ResponseFormat | None = None
    guided_json: JsonValue | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings, e.g. \"50256\"), got {key!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and (v == "" or (isinstance(v, list) and any(s == "" for s in v))):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class TextPart(_Closed):
    type: Literal["text"]
    text: str


class CalledFunction(_Closed):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text of an object, as OpenAI returns it


class MessageToolCall(_Closed):
    """A call an earlier assistant turn made (as the response's ``tool_calls`` returned it)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Closed):
    """One message. Content is a string or a list of text parts (joined); other part types are
    rejected by convert.py with the item's path. Assistant turns may carry ``tool_calls``, and
    ``tool`` turns (a call's result) a ``tool_call_id``."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted, no effect
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # Round-tripped assistant messages of the SDK carry these as null: accepted only when empty.
    function_call: Any | None = None
    refusal: str | None = None
    audio: Any | None = None


class FunctionDef(_Closed):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: JsonValue | None = None  # a JSON schema of an object; absent = no arguments
    strict: bool | None = None  # accepted: forced calls are always enforced strictly


class ToolDef(_Closed):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Closed):
    name: str


class NamedToolChoice(_Closed):
    """``tool_choice`` naming a function (tools.py validates it, so its errors name tool_choice)."""

    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PosInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | NamedToolChoice (tools.py)
    parallel_tool_calls: bool | None = None  # unset = true, as OpenAI
    # Accepted when it asks for nothing: false / null.
    store: Literal[False] | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[NonNegInt], Field(min_length=1)] | list[str] | list[list[NonNegInt]]
    max_tokens: PosInt | None = None  # OpenAI's default for completions is 16, as the router's
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: Literal[False] = False  # echoing the prompt back is not implemented
    best_of: PosInt | None = None
    suffix: None = None  # insertion (suffix) is not supported

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of == n is supported (every sample is returned)")
        return self
