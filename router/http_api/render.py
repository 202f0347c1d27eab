"""duet.v1.GenerateResponse stream -> OpenAI response JSON: streamed chunks (SSE) and whole responses,
for chat completions and completions, with per-choice logprobs and the request's usage.

Terms:
    choice    one of the request's n samples; every GenerateResponse names its own (``index``) and
              each choice's stream ends with its own finish_reason and usage.
    usage     prompt_tokens once (every choice has the same prompt), completion_tokens summed over
              the choices, prompt_tokens_details.cached_tokens the largest count any choice's
              worker served from its prefix cache.

Tool calls (chat with a ToolPlan that parses calls): each choice's text goes through a ToolOutput
(router/http_api/tool_output.py), which splits it into ``content`` and ``tool_calls``; a choice that
called a tool and stopped by itself ends with ``finish_reason: "tool_calls"``.

Logprob token strings: ``token`` is the token's text and ``bytes`` its exact UTF-8 bytes (for a
byte-level BPE tokenizer a token may hold part of a character: its ``token`` then shows U+FFFD, its
``bytes`` the real bytes, as OpenAI does).

Example chunk (chat, stream=true, n=1)::

    {"id": "chatcmpl-...", "object": "chat.completion.chunk", "created": 1764160000,
     "model": "SmolLM2-135M-Instruct", "choices": [{"index": 0, "delta": {"content": " Paris"},
     "logprobs": null, "finish_reason": null}]}
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protos.duet.v1 import duet_pb2
from router.http_api.tool_output import ToolOutput

FINISH = {duet_pb2.FINISH_REASON_STOP: "stop", duet_pb2.FINISH_REASON_LENGTH: "length",
          duet_pb2.FINISH_REASON_ABORT: "abort"}


class TokenText:
    """Token id -> (text, UTF-8 bytes), cached; exact bytes for byte-level BPE tokenizers."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_of = _byte_decoder(tokenizer)

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = None
            if self._byte_of:
                piece = self._tok.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in self._byte_of for c in piece):
                    raw = bytes(self._byte_of[c] for c in piece)
            if raw is None:
                raw = self._tok.decode([token_id]).encode()
            hit = (raw.decode("utf-8", errors="replace"), raw)
            self._cache[token_id] = hit
        return hit


def _byte_decoder(tokenizer: Any) -> dict[str, int]:
    """GPT-2's printable-character -> byte map when the tokenizer is byte-level BPE, else {}."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {} if backend is not None else {}
    except (AttributeError, ValueError):
        return {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", ())}
    if "ByteLevel" not in kinds:
        return {}
    # bytes_to_unicode (GPT-2): printable bytes map to themselves, the rest to U+0100 upwards.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class Choice:
    """What one choice produced so far (non-streaming responses accumulate here)."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0
    tools: ToolOutput | None = None
    message: dict[str, Any] | None = None  # content and tool_calls of a whole response with tools


@dataclass
class UsageTotal:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, u: duet_pb2.Usage) -> None:
        self.prompt_tokens = u.prompt_tokens
        self.completion_tokens += u.completion_tokens
        self.cached_tokens = max(self.cached_tokens, u.cached_prompt_tokens)

    def json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Renderer:
    """Turns one request's GenerateResponses into OpenAI JSON. ``chat``: chat.completion(.chunk)
    objects, else text_completion; ``logprobs``: whether the request asked for them; ``tools``: makes
    each choice's ToolOutput when the output is parsed for tool calls."""

    def __init__(self, *, chat: bool, request_id: str, model: str, token_text: TokenText, logprobs: bool,
                 tools: Callable[[], ToolOutput] | None = None) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = logprobs
        self.choices: dict[int, Choice] = {}
        self.usage = UsageTotal()
        self.tools = tools

    def _choice(self, index: int) -> Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = Choice(tools=self.tools() if self.tools is not None else None)
        return c

    def _finish(self, r: duet_pb2.GenerateResponse, c: Choice) -> None:
        c.finish_reason = FINISH.get(r.finish_reason, "abort")
        if c.finish_reason == "stop" and c.tools is not None and c.tools.called:
            c.finish_reason = "tool_calls"
        self.usage.add(r.usage)

    # -- streaming ------------------------------------------------------------------------------

    def chunk(self, r: duet_pb2.GenerateResponse) -> dict[str, Any] | None:
        """The chunk for one GenerateResponse, or None when it carries nothing at all. A response
        whose text is held back (a possible stop string or partial character) still gets a chunk,
        with empty content: the client sees progress at the pace tokens are generated, as over
        gRPC."""
        first = r.index not in self.choices
        c = self._choice(r.index)
        final = r.HasField("finish_reason")
        fields = c.tools.delta(r.text, final) if c.tools is not None else {"content": r.text}
        if final:
            self._finish(r, c)
        logprobs = self._logprobs(r, c) if self.want_logprobs else None
        if not (r.token_ids or r.text or final or first):
            return None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", **fields} if first else fields
            choice = {"index": r.index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        choice = {"index": r.index, "text": r.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with stream_options.include_usage (no choices)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage.json()}

    # -- whole responses -------------------------------------------------------------------------

    def add(self, r: duet_pb2.GenerateResponse) -> None:
        c = self._choice(r.index)
        c.texts.append(r.text)
        if self.want_logprobs:
            lp = self._logprobs(r, c)
            c.logprobs.append(lp)
        if r.HasField("finish_reason"):
            if c.tools is not None:
                c.message = c.tools.message("".join(c.texts))
            self._finish(r, c)

    def response(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.texts)
            logprobs = self._merge_logprobs(c.logprobs) if self.want_logprobs else None
            if self.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                if c.tools is not None:  # the choice ended (the pipeline always ends a choice with a finish)
                    message.update(c.message if c.message is not None else c.tools.message(text))
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage.json(),
                "system_fingerprint": None}

    # -- logprobs --------------------------------------------------------------------------------

    def _logprobs(self, r: duet_pb2.GenerateResponse, c: Choice) -> dict[str, Any]:
        text_of = self.token_text
        if self.chat:
            content = []
            for lp in r.logprobs:
                text, raw = text_of(lp.token_id)
                top = []
                for t in lp.top_logprobs:
                    t_text, t_raw = text_of(t.token_id)
                    top.append({"token": t_text, "logprob": t.logprob, "bytes": list(t_raw)})
                content.append({"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for lp in r.logprobs:
            text, _ = text_of(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            tops.append({text_of(t.token_id)[0]: t.logprob for t in lp.top_logprobs})
            offsets.append(c.text_offset)
            c.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _merge_logprobs(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        if self.chat:
            return {"content": [x for p in parts for x in p["content"]], "refusal": None}
        return {key: [x for p in parts for x in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                     "text_offset")}
