"""Tool-call formats of model families, behind one protocol (base.ToolFormat) and a registry.

Which format a model uses is read from its chat template: the first registered format whose
``matches_template`` accepts a tool-capable template. A template that cannot render tools (no
``tools`` variable, e.g. SmolLM2's) gets the default format, Hermes / Qwen2.5 ``<tool_call>`` tags:
the HTTP API then writes that format's system block into the prompt itself (router/http_api/chat_prompt.py).

Adding a format: a class with ToolFormat's methods in its own module here, then
``register(MyFormat())``. Example::

    fmt, native = format_for_template(template, renders_tools)   # Hermes for Qwen2.5 (native) and SmolLM2 (not)
    events = fmt.stream().feed(model_text)
"""

from __future__ import annotations

import logging

from router.tool_parsers.base import CallArgs, CallEnd, CallStart, Content, Event, StreamParser, ToolFormat
from router.tool_parsers.hermes import HermesFormat

logger = logging.getLogger(__name__)

DEFAULT = "hermes"
_FORMATS: dict[str, ToolFormat] = {}


def register(fmt: ToolFormat) -> None:
    if fmt.name in _FORMATS:
        raise ValueError(f"tool-call format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt


def get_format(name: str) -> ToolFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(_FORMATS))}") from None


def format_for_template(chat_template: str | None, renders_tools: bool) -> tuple[ToolFormat, bool]:
    """(format, native) for a model whose chat template is ``chat_template``; ``renders_tools``:
    whether the template renders tools itself. ``native``: the template renders tools in this
    format, so the prompt goes through the template; otherwise the format's own system block is
    written into the prompt. A tool-capable template in a format no registered parser knows gets
    the default format's block instead of its own (with a warning: the model then sees a format
    it may not have been trained on)."""
    if renders_tools and chat_template:
        for fmt in _FORMATS.values():
            if fmt.matches_template(chat_template):
                return fmt, True
        logger.warning("the chat template renders tools in a format no tool-call parser knows; prompting with "
                       "the %r format's system block instead", DEFAULT)
    return _FORMATS[DEFAULT], False


register(HermesFormat())

__all__ = ["CallArgs", "CallEnd", "CallStart", "Content", "Event", "StreamParser", "ToolFormat", "DEFAULT",
           "format_for_template", "get_format", "register"]
