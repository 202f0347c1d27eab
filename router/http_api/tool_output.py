"""One choice's output, parsed for tool calls, as OpenAI JSON: streamed deltas and whole messages.

Streaming follows OpenAI: a call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (with ``arguments: ""``), its later deltas ``index`` and argument pieces::

    {"tool_calls": [{"index": 0, "id": "call_3f..", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Par"}}]}

Text outside calls is ``content``. The pieces of a call's arguments concatenate to exactly the
``function.arguments`` a whole (non-streamed) response carries for the same output: the JSON text
the model wrote. Differences between the two: a block that starts as a call and turns out malformed
is a call already announced in a stream, while a whole response returns its text as content; a
call cut off by max_tokens streams partial arguments (finish_reason "length"), while a whole
response returns its text as content.

Example::

    out = ToolOutput(HermesFormat(), max_calls=None)
    out.delta('<tool_call>\\n{"name": "f", "arguments": {"a"', final=False)   # announces call 0
    out.delta(': 1}}\\n</tool_call>', final=True); out.called                  # True
"""

from __future__ import annotations

import uuid
from typing import Any

from router.tool_parsers import CallArgs, CallEnd, CallStart, Content, Event, ToolFormat


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolOutput:
    """Per choice. ``max_calls``: calls after the first ``max_calls`` are dropped (their text too)."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self._stream = fmt.stream()
        self.called = False  # a call was announced (streaming) or parsed (whole)

    def _kept(self, index: int) -> bool:
        return index >= 0 and (self.max_calls is None or index < self.max_calls)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields (``content`` and/or ``tool_calls``) for the next text of a stream."""
        events = self._stream.feed(text) if text else []
        if final:
            events += self._stream.finish()
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, CallStart) and self._kept(e.index):
                self.called = True
                calls.append({"index": e.index, "id": call_id(), "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, CallArgs) and self._kept(e.index):
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.text
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.text}})
            elif isinstance(e, CallEnd) and e.index < 0:
                content.append(e.raw)  # text in call tags that never named a function
        out: dict[str, Any] = {}
        if content or not calls:
            out["content"] = "".join(content)
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The message fields (``content``, ``tool_calls``) of a whole response whose text is ``text``."""
        events: list[Event] = self._stream.feed(text) + self._stream.finish()
        content: list[str] = []
        names: dict[int, str] = {}
        args: dict[int, list[str]] = {}
        calls: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, CallStart):
                names[e.index] = e.name
                args[e.index] = []
            elif isinstance(e, CallArgs):
                args[e.index].append(e.text)
            elif isinstance(e, CallEnd):
                if e.valid and self._kept(e.index):
                    calls.append({"id": call_id(), "type": "function",
                                  "function": {"name": names[e.index], "arguments": "".join(args[e.index])}})
                elif not e.valid:
                    content.append(e.raw)
        self.called = bool(calls)
        body = "".join(content)
        message: dict[str, Any] = {"content": body if body or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message
