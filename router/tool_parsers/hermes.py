"""The Hermes / Qwen2.5 tool-call format: each call is a JSON object in ``<tool_call>`` tags.

Model output with two calls and some text::

    Let me check both cities.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

Parsing: text outside the tags is content (whitespace that only separates it from calls is
dropped); inside, CallScanner (json_call.py) reads the object. A block that is not such an object
ends invalid: its CallEnd carries its raw text with the whitespace before it, so content + raw
blocks give back the model's text exactly. The closing tag may be missing at the
end of the output (e.g. cut by a stop string) or when text follows the object directly.

The prompt side is Qwen2.5's chat template's, word for word: ``system_block`` lists the tools in
``<tools>`` tags (one JSON object per line) and asks for the format above; past calls are rendered
as blocks and tool results as a user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from typing import Any

from router.tool_parsers.base import CallEnd, Content, Event
from router.tool_parsers.json_call import CallScanner

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_WS = " \t\r\n"

_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class HermesFormat:
    name = "hermes"

    def matches_template(self, chat_template: str) -> bool:
        return OPEN in chat_template

    def system_block(self, tools: list[dict[str, Any]]) -> str:
        return _SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{OPEN}\n{body}\n{CLOSE}"

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def forced_grammar(self, call_schemas: list[dict[str, Any]], parallel: bool) -> str:
        schema = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
        # Compact JSON: no free whitespace inside the call (a sampled model could otherwise emit
        # whitespace until max_tokens), separators as json.dumps writes them.
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f'{start}\ncall: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"\n'

    def stream(self) -> HermesStream:
        return HermesStream()


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (held back: it may
    be the start of the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesStream:
    """The incremental parser (see base.StreamParser)."""

    def __init__(self) -> None:
        self._in_call = False
        self._buf = ""  # text mode: held back (a possible tag start); call mode: text after the object
        self._ws = ""  # whitespace held back between content and what follows it
        self._called = False
        self._after_call = False
        self._count = 0
        self._scanner: CallScanner | None = None
        self._ws_before = ""  # whitespace dropped before the current call (restored if it is invalid)

    def _next_index(self) -> int:
        self._count += 1
        return self._count - 1

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            text = self._feed_call(text, events) if self._in_call else self._feed_text(text, events)
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._in_call:
            self._end_call(events, closed=False)
        if self._buf:
            self._content(self._buf, events)
            self._buf = ""
        if self._ws and not self._called:
            events.append(Content(self._ws))
        self._ws = ""
        return events

    # -- text outside calls ----------------------------------------------------------------------

    def _feed_text(self, text: str, events: list[Event]) -> str:
        """Consume ``text`` in text mode; return what belongs to a call that started in it."""
        buf = self._buf + text
        i = buf.find(OPEN)
        if i >= 0:
            self._content(buf[:i], events)
            self._buf = ""
            self._ws_before, self._ws = self._ws, ""  # whitespace before a call separates it from the content
            self._in_call = True
            self._scanner = CallScanner(self._next_index)
            return buf[i + len(OPEN):]
        keep = _held_prefix(buf, OPEN)
        self._content(buf[:len(buf) - keep], events)
        self._buf = buf[len(buf) - keep:]
        return ""

    def _content(self, text: str, events: list[Event]) -> None:
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(_WS)
        if not body:
            self._ws += text
            return
        events.append(Content(self._ws + body))
        self._ws = text[len(body):]

    # -- inside a call ---------------------------------------------------------------------------

    def _feed_call(self, text: str, events: list[Event]) -> str:
        scanner = self._scanner
        assert scanner is not None
        if not (scanner.done or scanner.error):
            events += scanner.feed(text)
            if not (scanner.done or scanner.error):
                return ""
            text, scanner.rest = scanner.rest, ""
        buf = self._buf + text
        if scanner.error:  # skip to the closing tag
            j = buf.find(CLOSE)
            if j < 0:
                self._buf = buf
                return ""
            self._buf = buf[:j]
            self._end_call(events, closed=True)
            return buf[j + len(CLOSE):]
        stripped = buf.lstrip(_WS)
        if stripped.startswith(CLOSE):
            self._buf = buf[:len(buf) - len(stripped)]
            self._end_call(events, closed=True)
            return stripped[len(CLOSE):]
        if CLOSE.startswith(stripped):  # whitespace or the tag's start so far: wait
            self._buf = buf
            return ""
        self._buf = ""  # text right after the object: the call ended without its tag
        self._end_call(events, closed=False)
        return buf

    def _end_call(self, events: list[Event], closed: bool) -> None:
        scanner = self._scanner
        assert scanner is not None
        events += scanner.finish()
        raw = OPEN + scanner.raw + scanner.rest + self._buf + (CLOSE if closed else "")
        valid = scanner.valid
        # An invalid block is text after all (a whole response returns it as content): keep its spacing.
        events.append(CallEnd(scanner.index, raw if valid else self._ws_before + raw, valid))
        if scanner.index >= 0:
            self._called = True
        self._in_call, self._scanner, self._buf, self._ws_before = False, None, "", ""
        self._after_call = valid

