"""Config sections derived from the worker and router config types: one definition per setting.

A section of the deployment config (``model``, ``pools[i].engine``, ``router``) exposes fields of
lower-layer config types under the YAML names users write. Each field is declared once, in its
owner (``workers.config.CacheConfig.block_size``): ``derived_section`` builds a pydantic model
whose field takes the owner's type, default and description (the owner docstring's
``name: text`` entry, or the Part's ``doc``), and ``check_derived`` validates a built section by
constructing each owner from its fields, so the owner's own ``__post_init__`` checks run and its
message is renamed to the dotted YAML key (cluster/config/sources.py ``lower_error``).

Worked example::

    @derived_section([
        ("block_size", Part(CacheConfig, "block_size")),          # type int, default 16, from CacheConfig
        ("max_num_seqs", Part(SchedulerConfig, "max_num_seqs")),
    ])
    class EngineSection(DerivedSection):
        '''Per-worker engine settings.'''
    # pools[0].engine.block_size=24 (from duet.yaml): must be a power of two >= 1   (CacheConfig's check)
    owner_kwargs(section, CacheConfig)   # {"block_size": 24}: what to build the worker config from
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar, cast

from pydantic import AfterValidator, BaseModel, ByteSize, ConfigDict, Field, WithJsonSchema, create_model

from cluster.config.sources import KeyMap, Sources, is_lower_config_error, lower_error

# An int of bytes, written as one or with a unit: 64MiB, 1GiB, 500MB (pydantic's ByteSize).
ByteCount = Annotated[ByteSize, AfterValidator(int), WithJsonSchema({
    "type": ["integer", "string"], "minimum": 0, "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*([kKmMgGtT]i?[bB]|[bB])?\s*$"})]
# A ByteCount or the word "auto" (the owner resolves it where it runs: CacheConfig.host_tier_bytes).
AutoByteCount = Annotated[Literal["auto"] | ByteCount, WithJsonSchema({
    "type": ["integer", "string"], "minimum": 0,
    "pattern": r"^\s*(auto|[0-9]+(\.[0-9]+)?\s*([kKmMgGtT]i?[bB]|[bB])?)\s*$"})]


class Section(BaseModel):
    """A config section: frozen, unknown keys refused, numbers accepted where text is expected."""

    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Part:
    """A section field that is ``owner``'s field ``name`` (its type, default and checks). doc: the
    description where the owner's docstring has none; type: the type users write (e.g. ByteCount)."""

    owner: type
    name: str
    doc: str | None = None
    type: Any = None


class DerivedSection(Section):
    """The base of every ``derived_section`` model: which owner field each of its fields is (PARTS)
    and the probe values (PROBE). The fields themselves are added by pydantic's create_model at
    import, out of a type checker's sight: for mypy they read as Any (pydantic validates them)."""

    PARTS: ClassVar[dict[str, Part]] = {}
    PROBE: ClassVar[dict[type, dict[str, Any]]] = {}

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...


D = TypeVar("D", bound=DerivedSection)


def derived_section(fields: Sequence[tuple[str, Part | tuple[Any, Any]]], *,
                    probe: dict[type, dict[str, Any]] | None = None) -> Callable[[type[D]], type[D]]:
    """A class decorator: the decorated class (a ``DerivedSection``) becomes the section model of its
    name, docstring and bases whose fields are ``fields`` in order: a ``Part`` takes its type, default
    and description from the owner; a ``(type, Field(...))`` is the section's own. probe: values an
    owner needs to be built for validation that the section does not carry (RouterConfig's tokenizer_path)."""
    return lambda cls: _build_section(cls, fields, probe)


def _build_section(cls: type[D], fields: Sequence[tuple[str, Part | tuple[Any, Any]]],
                   probe: dict[type, dict[str, Any]] | None) -> type[D]:
    specs: dict[str, Any] = {}
    parts = {}
    for field_name, spec in fields:
        if isinstance(spec, Part):
            owner_field = {f.name: f for f in dataclasses.fields(spec.owner)}[spec.name]
            hint = spec.type or typing.get_type_hints(spec.owner)[spec.name]
            default = (dict(default_factory=owner_field.default_factory)
                       if owner_field.default_factory is not dataclasses.MISSING
                       else dict(default=owner_field.default) if owner_field.default is not dataclasses.MISSING
                       else {})  # required (an adapter's name and source)
            specs[field_name] = (hint, Field(**default, description=spec.doc or field_docs(spec.owner)[spec.name]))
            parts[field_name] = spec
        else:
            specs[field_name] = spec
    model = cast(type[D], create_model(cls.__name__, __base__=cls.__bases__, __doc__=cls.__doc__,
                                       __module__=cls.__module__, **specs))
    model.PARTS, model.PROBE = parts, dict(probe or {})
    return model


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field descriptions from its docstring's ``name: text`` (or ``a / b: text``)
    entries, continuation lines joined."""
    docs: dict[str, str] = {}
    names: list[str] = []
    indent = -1
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        m = re.match(r"^(\s*)([a-z_]+(?:\s*/\s*[a-z_]+)*):\s+(.*)$", line)
        depth = len(line) - len(line.lstrip())
        if m and (indent < 0 or depth <= indent):
            indent, names = depth, re.split(r"\s*/\s*", m.group(2))
            docs.update({n: m.group(3).strip() for n in names})
        elif names and line.strip() and depth > indent:
            docs.update({n: f"{docs[n]} {line.strip()}" for n in names})
        else:
            names = []
    return docs


def owners(section: Any) -> list[type]:
    """The lower config types ``section``'s fields come from, in field order."""
    return list(dict.fromkeys(p.owner for p in type(section).PARTS.values()))


def owner_kwargs(section: Any, owner: type) -> dict[str, Any]:
    """``owner``'s constructor arguments held by ``section`` (owner field name -> value)."""
    return {p.name: getattr(section, f) for f, p in type(section).PARTS.items() if p.owner is owner}


def keymap(section: Any, prefix: str, owner: type | None = None) -> KeyMap:
    """Owner field name (as the owner's messages spell it) -> (dotted key, value) for ``section``."""
    out = {}
    for f, p in type(section).PARTS.items():
        if owner is None or p.owner is owner:
            key_prefix = getattr(p.owner, "KEY_PREFIX", "")
            out[key_prefix + p.name] = (f"{prefix}.{f}" if prefix else f, getattr(section, f))
    return out


def check_derived(section: Any, prefix: str, sources: Sources) -> None:
    """Build every owner of ``section`` from its fields: the owner's own checks, with dotted keys."""
    probe = type(section).PROBE
    for owner in owners(section):
        try:
            owner(**owner_kwargs(section, owner), **probe.get(owner, {}))
        except ValueError as e:
            if not is_lower_config_error(e):
                raise
            raise lower_error(e, keymap(section, prefix, owner), sources) from None
