"""OpenAI request bodies -> duet.v1.GenerateRequest: the HTTP API asks the same pipeline the same
question the gRPC API does, so everything past this file (tokenizing, chat template, admission,
routing, stop strings, detokenizing, the n fan-out) is shared.

Mapping (OpenAI field -> duet.v1 field):

    messages (chat) / prompt (completions)     messages / prompt or prompt_token_ids
    max_completion_tokens, else max_tokens     sampling.max_tokens; unset: chat = up to the context
                                               limit (OpenAI's default), completions = 16 (OpenAI's)
    n, seed, stop, temperature, top_p          n, sampling.*
    top_k (-1 = off), min_p, min_tokens        sampling.*
    presence/frequency/repetition_penalty      sampling.*
    logit_bias {"id": bias}                    sampling.logit_bias {id: bias}
    logprobs + top_logprobs (chat)             sampling.top_logprobs (unset when logprobs is false)
    logprobs k (completions)                   sampling.top_logprobs = k
    ignore_eos, stop_token_ids (vLLM)          sampling.*
    model                                      model ("" or the served name)
    response_format, guided_*, structured_outputs  sampling.structured (router/http_api/structured.py)
    tools, tool_choice (required / named)      sampling.structured: a grammar (router/http_api/tools.py)

Chat roles: system, user, assistant, tool, and developer (OpenAI's newer name for system: sent to
the chat template as "system"). Text content parts are joined; other parts are 400s. A chat with
tools in its prompt or with tool turns is rendered here (router/http_api/chat_prompt.py) and sent
as prompt_token_ids; any other chat goes as messages, which the pipeline renders (as for gRPC).
"""

from __future__ import annotations

from typing import Any

from protos.duet.v1 import duet_pb2
from router.http_api.chat_prompt import ChatPrompt, parse_arguments
from router.http_api.errors import invalid, unsupported
from router.http_api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Sampling
from router.http_api.structured import Structured
from router.http_api.tools import ToolPlan

_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system", "tool": "tool"}
_UNSUPPORTED_FIELDS = ("function_call", "audio")


def chat_request(body: ChatCompletionRequest, request_id: str, max_model_len: int, prompt: ChatPrompt,
                 plan: ToolPlan | None, structured: Structured | None) -> duet_pb2.GenerateRequest:
    """The request for a chat; ``plan`` and ``structured`` as tools.make_plan / structured.from_request
    made them for ``body``."""
    request = duet_pb2.GenerateRequest(request_id=request_id, model=body.model or "", n=body.n or 1)
    turns = chat_turns(body.messages)
    if (plan is not None and plan.prompt_tools) or any(t["role"] == "tool" or "tool_calls" in t for t in turns):
        request.prompt_token_ids.ids.extend(prompt.ids(turns, plan))
    else:
        chat = request.messages
        chat.SetInParent()
        for t in turns:
            chat.messages.add(role=t["role"], content=t["content"])
    forced = plan.structured if plan is not None else None
    if forced is not None or structured is not None:
        request.sampling.structured.CopyFrom((forced or structured).proto)  # type: ignore[union-attr]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # No limit given: as OpenAI, up to the context (the router clamps to context - prompt).
    _sampling(request.sampling, body, max_tokens if max_tokens is not None else max_model_len)
    if body.logprobs:
        request.sampling.top_logprobs = body.top_logprobs or 0
    return request


def completion_request(body: CompletionRequest, request_id: str,
                       structured: Structured | None) -> duet_pb2.GenerateRequest:
    request = duet_pb2.GenerateRequest(request_id=request_id, model=body.model or "", n=body.n or 1)
    prompt = _single_prompt(body.prompt)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    _sampling(request.sampling, body, body.max_tokens)
    if body.logprobs is not None:
        request.sampling.top_logprobs = body.logprobs
    if structured is not None:
        request.sampling.structured.CopyFrom(structured.proto)
    return request


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must be a non-empty string")
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1:  # a batch of one: ["text"] or [[ids]]
        return _single_prompt(prompt[0])  # type: ignore[arg-type]
    raise unsupported("prompt", f"a batch of {len(prompt)} prompts; send one prompt per request "
                                "(a string or a list of token ids)")


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as template turns: {"role", "content"} plus, for an assistant turn that called
    tools, "tool_calls": [{"id", "name", "arguments": {...}}], and for a tool turn "tool_call_id"."""
    turns = []
    for i, m in enumerate(messages):
        turn: dict[str, Any] = {"role": _role(i, m), "content": _content(i, m)}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "name": c.function.name,
                                   "arguments": parse_arguments(f"messages[{i}].tool_calls[{j}].function.arguments",
                                                                c.function.arguments)}
                                  for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
        turns.append(turn)
    return turns


def _role(i: int, m: ChatMessage) -> str:
    for name in _UNSUPPORTED_FIELDS:
        if getattr(m, name):
            raise unsupported(f"messages[{i}].{name}", "not supported (function_call: use tools; audio: text only)")
    role = _ROLES.get(m.role)
    if role is None:
        if m.role == "function":
            raise unsupported(f"messages[{i}].role", "'function' messages (deprecated by OpenAI) are not supported; "
                                                     "send tool results as 'tool' messages")
        raise invalid(f"messages[{i}].role", f"must be one of system, user, assistant, tool, developer; got {m.role!r}")
    if m.tool_calls and role != "assistant":
        raise invalid(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
    if role == "tool" and not m.tool_call_id:
        raise invalid(f"messages[{i}].tool_call_id", "required for role 'tool' (the id of the call this answers)",
                      code="missing_required_parameter")
    if m.tool_call_id is not None and role != "tool":
        raise invalid(f"messages[{i}].tool_call_id", "only tool messages carry a tool_call_id")
    return role


def _content(i: int, m: ChatMessage) -> str:
    if m.content is None:
        if m.role == "assistant":
            return ""  # an assistant turn that only refused (refusal is its text) or only called tools
        raise invalid(f"messages[{i}].content", "required for this role")
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"messages[{i}].content[{j}].text", "must be a string")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise unsupported(f"messages[{i}].content[{j}].{extra[0]}", "unknown field of a text part")
            texts.append(text)
        elif isinstance(kind, str):
            raise unsupported(f"messages[{i}].content[{j}].type",
                              f"{kind!r} content parts are not supported (text only)")
        else:
            raise invalid(f"messages[{i}].content[{j}].type", "each content part needs a string 'type'")
    return "".join(texts)


def _sampling(s: duet_pb2.SamplingParams, body: _Sampling, max_tokens: int | None) -> None:
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "min_p"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.top_k is not None and body.top_k > 0:
        s.top_k = body.top_k
    if body.min_tokens:
        s.min_tokens = body.min_tokens
    s.stop.extend(body.stop_list())
    s.stop_token_ids.extend(body.stop_token_ids or ())
    s.ignore_eos = body.ignore_eos
    for token_id, bias in body.logit_bias_ids().items():
        if token_id >= 2**32:
            raise invalid(f"logit_bias.{token_id}", "not a token id")
        s.logit_bias[token_id] = bias
