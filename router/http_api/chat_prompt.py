"""Chat prompts with tools: OpenAI messages (with ``tool`` turns and assistant ``tool_calls``) and
the tools a ToolPlan lists -> prompt token ids, through the model's chat template.

Plain chats (no tools in the prompt, no tool turns) are not rendered here: they go to the router
as ``messages`` and the shared pipeline applies the template (router/preprocess.py), as for gRPC.
Everything else is rendered here and sent as ``prompt_token_ids``, in one of two ways:

native      the template renders tools itself (it reads a ``tools`` variable) in a format a parser
            knows (router/tool_parsers/): ``apply_chat_template(messages, tools=...)``, with
            assistant calls as ``{"tool_calls": [{"type": "function", "function": {"name",
            "arguments": {...}}}]}`` and results as ``{"role": "tool", "content", "tool_call_id"}``
            (the transformers convention, which Qwen2.5's template follows).
default     the template knows no tools (e.g. SmolLM2's): the format's system block (Hermes /
            Qwen2.5: the tools in ``<tools>`` tags and how to call them) is appended to the system
            message (or is the system message when there is none), past calls are written into
            their assistant turn as the format's call blocks, and consecutive tool results become
            one user turn of ``<tool_response>`` blocks -- what Qwen2.5's template writes.

Example (default, SmolLM2)::

    ChatPrompt(tokenizer).ids([user("weather in Paris?")], plan)
    # <|im_start|>system\\n# Tools\\n\\nYou may call one or more functions ... <|im_end|>
    # <|im_start|>user\\nweather in Paris?<|im_end|>\\n<|im_start|>assistant\\n
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2
import jinja2.meta

from router.http_api.errors import invalid
from router.http_api.tools import ToolPlan
from router.tool_parsers import ToolFormat, format_for_template

ChatTurn = dict[str, Any]


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads a ``tools`` variable (so passing tools changes its output)."""
    if not chat_template:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
    except jinja2.TemplateSyntaxError:  # custom tags (e.g. {% generation %}): look for the name itself
        return re.search(r"\btools\b", chat_template) is not None


class ChatPrompt:
    """Renders tool conversations for one tokenizer (the template is inspected once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.fmt, self.native = format_for_template(template, template_renders_tools(template))

    def ids(self, turns: list[ChatTurn], plan: ToolPlan | None) -> list[int]:
        """Prompt token ids for ``turns`` (normalised messages: see convert.chat_turns)."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise invalid("messages", "this model's tokenizer has no chat template; use /v1/completions")
        tools = plan.prompt_tools if plan is not None else []
        kwargs: dict[str, Any] = {}
        if self.native:
            conversation = [_native_turn(t) for t in turns]
            if tools:
                kwargs["tools"] = tools
        else:
            conversation = _default_turns(turns, tools, self.fmt)
        try:
            text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja2 raise_exception() in a template: the conversation is malformed
            raise invalid("messages", f"the chat template rejected the conversation: {e}") from None
        # The template already wrote any BOS/special tokens as text, so add none here (as preprocess.py).
        return list(tok.encode(text, add_special_tokens=False))


def _native_turn(t: ChatTurn) -> ChatTurn:
    if t.get("tool_calls"):
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in t["tool_calls"]]
        return {"role": "assistant", "content": t["content"], "tool_calls": calls}
    return dict(t)


def _default_turns(turns: list[ChatTurn], tools: list[dict[str, Any]], fmt: ToolFormat) -> list[ChatTurn]:
    out: list[ChatTurn] = []
    results: list[str] = []
    for t in turns:
        if t["role"] == "tool":
            results.append(t["content"])
            continue
        if results:
            out.append({"role": "user", "content": fmt.render_results(results)})
            results = []
        if t.get("tool_calls"):
            blocks = "\n".join(fmt.render_call(c["name"], c["arguments"]) for c in t["tool_calls"])
            out.append({"role": "assistant", "content": f"{t['content']}\n{blocks}" if t["content"] else blocks})
        else:
            out.append({"role": t["role"], "content": t["content"]})
    if results:
        out.append({"role": "user", "content": fmt.render_results(results)})
    if tools:
        block = fmt.system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def parse_arguments(field: str, arguments: str) -> dict[str, Any]:
    """A past call's ``function.arguments`` (JSON text) as the object it holds."""
    try:
        value = json.loads(arguments)
    except ValueError as e:
        raise invalid(field, f"not valid JSON ({e}); send the arguments object as JSON text") from None
    if not isinstance(value, dict):
        raise invalid(field, f"must be the JSON text of an object, got {type(value).__name__}")
    return value
