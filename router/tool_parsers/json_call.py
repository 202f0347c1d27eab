"""CallScanner: reads one call object ``{"name": "...", "arguments": {...}}`` incrementally, as a
model writes it, and emits the call's name as soon as it is complete and its arguments' JSON text
piece by piece (formats that wrap such an object in tags, e.g. Hermes, share it).

How: a character-level JSON lexer that only tracks what it needs -- nesting depth, strings and
their escapes, and at the object's top level the current key and where its value started. A value
ends at the first ``,`` or ``}`` at the top level outside strings. The value of ``arguments`` (or
``parameters``, which some models write) is streamed raw, minus trailing whitespace, once the name
is known (arguments written before the name are held until then). Arguments written as a JSON
*string* holding JSON (some models double-encode) are decoded once complete.

Example::

    s = CallScanner(lambda: 0)
    s.feed('{"name": "get_weather", "arguments": {"ci')  # [CallStart(0, "get_weather"), CallArgs(0, '{"ci')]
    s.feed('ty": "Paris"}}\\n')                           # [CallArgs(0, 'ty": "Paris"}')]; s.done, s.rest == "\\n"
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from router.tool_parsers.base import CallArgs, CallStart, Event

_WS = " \t\r\n"
_ARG_KEYS = ("arguments", "parameters")


class CallScanner:
    """One call object; ``next_index`` gives the call its index when its name is known."""

    def __init__(self, next_index: Callable[[], int]) -> None:
        self._next_index = next_index
        self.index = -1  # set at CallStart
        self.raw = ""  # everything fed that belongs to the object (after ``done``: up to its '}')
        self.rest = ""  # text fed after the object's closing '}'
        self.done = False
        self.error = False
        self.name: str | None = None
        self.arguments: str | None = None  # the arguments' complete JSON text, once known
        self._phase = "start"  # start | key | colon | value_ws | value | after_value
        self._in_str = False
        self._esc = False
        self._depth = 0  # nesting inside the current value
        self._key_start = 0
        self._key = ""
        self._value_start = 0
        self._last_solid = -1  # index in raw of the current value's last non-whitespace char
        self._args_sent = 0  # raw index up to which streamed arguments were emitted
        self._pending_args = False  # arguments seen before the name

    @property
    def valid(self) -> bool:
        """A complete object with a string name and arguments that are a JSON object."""
        if not self.done or self.error or self.name is None:
            return False
        try:
            return isinstance(json.loads(self.arguments if self.arguments is not None else "{}"), dict)
        except ValueError:
            return False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.done or self.error:
            self.rest += text
            return events
        for k, ch in enumerate(text):
            self.raw += ch
            self._step(ch, events)
            if self.done or self.error:
                self.rest = text[k + 1:]
                break
        self._stream_args(events)
        return events

    def finish(self) -> list[Event]:
        """The object ended where the output did: name the call if it never did, complete its arguments
        (``{}`` when there were none)."""
        events: list[Event] = []
        if self.done and not self.error and self.name is not None and self.index < 0:
            self._start(events)
        if self.done and not self.error and self.index >= 0 and self.arguments is None:
            self.arguments = "{}"
            events.append(CallArgs(self.index, "{}"))
        return events

    # -- the lexer -------------------------------------------------------------------------------

    def _step(self, ch: str, events: list[Event]) -> None:
        phase = self._phase
        pos = len(self.raw) - 1
        if phase == "start":
            if ch == "{":
                self._phase = "key"
            elif ch not in _WS:
                self.error = True
        elif phase == "key":
            if self._in_str:
                self._string_char(ch)
                if not self._in_str:
                    try:
                        self._key = json.loads(self.raw[self._key_start:pos + 1])
                    except ValueError:
                        self.error = True
                    self._phase = "colon"
            elif ch == '"':
                self._in_str, self._key_start = True, pos
            elif ch == "}":
                self.done = True
            elif ch not in _WS:
                self.error = True
        elif phase == "colon":
            if ch == ":":
                self._phase = "value_ws"
            elif ch not in _WS:
                self.error = True
        elif phase == "value_ws":
            if ch not in _WS:
                self._phase, self._value_start, self._depth = "value", pos, 0
                self._args_sent = pos
                self._value_char(ch, pos, events)
        else:  # value
            self._value_char(ch, pos, events)

    def _string_char(self, ch: str) -> None:
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            self._in_str = False

    def _value_char(self, ch: str, pos: int, events: list[Event]) -> None:
        if self._in_str:
            self._string_char(ch)
            self._last_solid = pos
            return
        if self._depth == 0 and ch in ",}":
            self._end_value(events)
            if ch == "}":
                self.done = True
            else:
                self._phase = "key"
            return
        if ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth < 0:
                self.error = True
        if ch not in _WS:
            self._last_solid = pos

    def _end_value(self, events: list[Event]) -> None:
        value = self.raw[self._value_start:self._last_solid + 1]
        if self._key == "name":
            try:
                name: Any = json.loads(value)
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.error = True
                return
            self.name = name
            self._start(events)
        elif self._key in _ARG_KEYS and self.arguments is None:
            self._stream_args(events, end=True)

    # -- events ----------------------------------------------------------------------------------

    def _start(self, events: list[Event]) -> None:
        if self.index >= 0:
            return
        self.index = self._next_index()
        events.append(CallStart(self.index, self.name or ""))
        if self._pending_args:
            self._pending_args = False
            if self.arguments is not None:
                events.append(CallArgs(self.index, self.arguments))

    def _stream_args(self, events: list[Event], end: bool = False) -> None:
        """Emit the arguments written since the last call (raw JSON), or all of them at ``end``."""
        in_args = self._phase == "value" and self._key in _ARG_KEYS and self.arguments is None
        if not in_args or self.error:
            return
        string_valued = self.raw[self._value_start] == '"'
        if not end and (string_valued or self.index < 0):
            self._pending_args = self.index < 0
            return  # a string is decoded whole; without a name nothing is sent yet
        full = self.raw[self._value_start:self._last_solid + 1]
        if end:
            if string_valued:
                try:
                    decoded = json.loads(full)
                except ValueError:
                    self.error = True
                    return
                if not isinstance(decoded, str):
                    self.error = True
                    return
                full = decoded
            self.arguments = full
            if self.index < 0:
                self._pending_args = True
                return
            if string_valued:
                events.append(CallArgs(self.index, full))
                return
        upto = self._last_solid + 1
        if upto > self._args_sent:
            events.append(CallArgs(self.index, self.raw[self._args_sent:upto]))
            self._args_sent = upto
