"""OpenAI-style errors for the HTTP API: one exception type, one JSON shape, one status table.

Every error the HTTP API answers has the body OpenAI (and vLLM) use::

    {"error": {"message": "temperature: must be >= 0, got -1", "type": "invalid_request_error",
               "param": "temperature", "code": "invalid_value"}}

``param`` is the request field at fault (dotted path with [i] for list items, as the message
starts with) or null. Statuses, following OpenAI and vLLM:

    400 invalid_request_error   malformed JSON, wrong type, out-of-range value, unsupported field,
                                over-long prompt (code context_length_exceeded)
    401 authentication_error    missing / malformed / unknown bearer token
    403 permission_error        the token lacks the scope
    404 invalid_request_error   unknown model (code model_not_found) or path
    413 invalid_request_error   the body is larger than router.max_request_bytes
    429 rate_limit_error        admission control is full (retry with backoff)
    503 server_error            no healthy worker, or the worker died mid-stream (retryable)
    504 server_error            the request's deadline passed
    500 server_error            a router bug (the router's log has the traceback)

A RequestError from the shared pipeline (router/preprocess.py: gRPC status + "field: message")
maps through ``from_request_error``: the same validation answers both APIs, only the wire differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from router.preprocess import RequestError

# gRPC status of a pipeline RequestError -> (HTTP status, OpenAI error type, code)
_BY_GRPC: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "insufficient_scope"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
}
# The pipeline names proto fields; a client of this API sent the OpenAI ones.
_PARAM_RENAMES = {"prompt_token_ids": "prompt"}
_FIELD_RE = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class OpenAIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    """400 for a bad value of ``param``; the message starts with the field's name."""
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def from_request_error(e: RequestError, rename: Callable[[str], str] | None = None) -> OpenAIError:
    """The HTTP answer for a pipeline RequestError (see the module docstring's table). ``rename``
    maps the field the pipeline named to the one this request sent (e.g. ``structured.regex`` ->
    ``guided_regex``)."""
    status, type_, code = _BY_GRPC.get(e.code, (500, "server_error", None))
    m = _FIELD_RE.match(e.message)
    param = None
    message = e.message
    if m:
        param = m.group(1)
        if param.startswith("sampling."):
            param = param[len("sampling."):]
        for proto_name, ours in _PARAM_RENAMES.items():
            if param == proto_name or param.startswith((proto_name + "[", proto_name + ".")):
                param = ours + param[len(proto_name):]
        if rename is not None:
            param = rename(param)
        message = f"{param}: {e.message[m.end():]}"
    if status == 400 and param in ("prompt", "messages") and "limit is" in e.message:
        code = "context_length_exceeded"
    return OpenAIError(status, message, type=type_, param=param, code=code)


def from_pydantic(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """400 naming the first invalid field of a pydantic ValidationError's ``errors()``."""
    first = errors[0]
    param = loc_to_param(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return unsupported(param, "unknown or unsupported field (Duet answers text chat and completions; "
                                  "functions/function_call (use tools), audio and images are not supported)")
    if kind == "missing":
        return invalid(param, "required field is missing", code="missing_required_parameter")
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    named = _FIELD_RE.match(message)
    if not param and named:  # a check across fields names its field itself: "top_logprobs: needs ..."
        return invalid(named.group(1), message[named.end():])
    if "input" in first and kind not in ("json_invalid",) and not isinstance(first["input"], (dict, list)):
        message = f"{message}, got {first['input']!r}"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return invalid(param or "body", f"{message}{more}")


def loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str:
    """("messages", 0, "content") -> "messages[0].content"; pydantic's union-branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part[:1].isupper() or "[" in part or part in _UNION_TAGS):
            continue  # "list[int]", "ChatMessage", "str": which union member failed, not a field
        else:
            out += f".{part}" if out else str(part)
    return out


_UNION_TAGS = {"str", "int", "float", "bool", "function-after", "function-before", "function-wrap",
               "json-or-python", "list", "dict", "nullable"}
