"""The types every tool-call format shares: the events a format's stream parser emits, and the
ToolFormat protocol (one class per model family's format, registered in router/tool_parsers/__init__.py).

Terms:
    tool          an OpenAI function tool: ``{"type": "function", "function": {"name", "description",
                  "parameters"}}`` (``parameters`` a JSON schema of an object).
    call block    the text a model writes for one call in its family's format, e.g. Hermes / Qwen2.5:
                  ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``.
    events        what parsing a model's output yields, in order: ``Content`` (text outside call
                  blocks), and per call ``CallStart`` (its name), ``CallArgs`` (the arguments' JSON
                  text in pieces, as the model writes it) and ``CallEnd`` (whether the block was valid).

A format is used in both directions: it renders tools (and past calls) into the prompt when the
model's chat template cannot, it builds the grammar that forces a call (``tool_choice`` required or
a named function), and it parses the model's output back into calls, whole or streamed.

Example (Hermes)::

    stream = HermesFormat().stream()
    stream.feed('Sure. <tool_call>\\n{"name": "f", "argu')   # [Content("Sure. "), CallStart(0, "f")]
    stream.feed('ments": {"a": 1}}\\n</tool_call>')        # [CallArgs(0, '{"a": 1}'), CallEnd(0, ..., True)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Content:
    """Text outside any call block."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call ``index`` (0, 1, ... in output order) names its function."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArgs:
    """The next piece of call ``index``'s arguments (JSON text; the pieces concatenate to it)."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """Call ``index`` is over. ``valid``: its block held a function name and a JSON object of
    arguments; otherwise ``raw`` is the whole block as the model wrote it (a whole-response parse
    returns it as content)."""

    index: int
    raw: str
    valid: bool


Event = Content | CallStart | CallArgs | CallEnd


class StreamParser(Protocol):
    """Parses one output incrementally. ``feed`` takes the next text delta, ``finish`` ends the
    output (flushing held-back text and closing a call the output ended inside)."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class ToolFormat(Protocol):
    """One model family's tool-call format (see the module docstring)."""

    name: str

    def matches_template(self, chat_template: str) -> bool:
        """Whether a tool-capable chat template writes calls in this format."""

    def system_block(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt text that lists ``tools`` and explains the format (for templates
        that cannot render tools themselves)."""

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One past call as the model would have written it (for templates without tool support)."""

    def render_results(self, results: list[str]) -> str:
        """The content of the user turn that carries consecutive tool results to the model."""

    def forced_grammar(self, call_schemas: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose outputs are one call (``parallel`` false) or
        one or more calls, each an object ``{"name", "arguments"}`` valid against one of
        ``call_schemas``."""

    def stream(self) -> StreamParser:
        """A fresh incremental parser for one output."""
