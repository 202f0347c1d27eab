"""What a request asks its output to look like: the structured-output spec, validated on construction.

Terms:
    kind        which constraint: "json_object" (any JSON object), "json_schema" (a JSON value that
                validates against the schema, strictly: no properties the schema does not allow),
                "regex" (the whole output matches the regular expression), "choice" (the output is
                exactly one of ``choices``), "grammar" (the output parses with a Lark-style grammar
                in llguidance's dialect: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md).
    value       the schema's JSON text, the regex or the grammar text ("" for json_object and choice).
    choices     the allowed outputs for "choice" (non-empty strings; () for the other kinds).

This module is pure Python (no torch, no grammar library): the router and the workers both build it.
Compiling the spec into a grammar (and the errors that only a compile finds: an unsupported schema
feature, a regex that does not compile) is workers/structured/grammar.py's job.

Worked example::

    StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    StructuredOutput("choice", choices=("yes", "no"))
    StructuredOutput("regex", r"\\d{3}-\\d{4}")
    StructuredOutput("regex", "")   # InvalidRequestError: "structured.regex: must be a non-empty ..."
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from workers.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # schema / regex / grammar text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """A structured-output constraint; see the module docstring. Errors name ``structured.<kind>``."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in KINDS:
            raise InvalidRequestError("structured", f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        field = self.field
        if not isinstance(self.value, str):
            raise InvalidRequestError(field, f"must be a string, got {type(self.value).__name__}")
        if self.kind in ("json_object", "choice"):
            if self.value:
                raise InvalidRequestError(field, "takes no value text (json_object allows any JSON object; "
                                                 "choice takes its choices)")
        elif not self.value.strip():
            raise InvalidRequestError(field, "must be a non-empty string")
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(field, f"at most {MAX_SPEC_CHARS} characters, got {len(self.value)}")
        if self.kind == "json_schema":
            self._check_schema_text()
        self._check_choices()

    @property
    def field(self) -> str:
        """The request field this spec came from, for error messages (e.g. ``structured.regex``)."""
        return f"structured.{self.kind}"

    def _check_schema_text(self) -> None:
        try:
            schema = json.loads(self.value)
        except ValueError as e:
            raise InvalidRequestError(self.field, f"not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(self.field, f"a JSON schema must be an object (or true/false), "
                                                  f"got {type(schema).__name__}")

    def _check_choices(self) -> None:
        if self.kind != "choice":
            if self.choices:
                raise InvalidRequestError(self.field, "takes no choices (only kind 'choice' does)")
            return
        if not 0 < len(self.choices) <= MAX_CHOICES:
            raise InvalidRequestError("structured.choice", f"must hold 1..{MAX_CHOICES} choices, "
                                                           f"got {len(self.choices)}")
        for i, c in enumerate(self.choices):
            if not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS:
                raise InvalidRequestError(f"structured.choice[{i}]", f"each choice must be a non-empty string "
                                                                     f"of at most {MAX_CHOICE_CHARS} characters")
