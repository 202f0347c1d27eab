"""Config sections derived from the worker and router config types: one definition per setting.

A section of the deployment config (``model``, ``pools[i].engine``, ``router``) exposes fields of
lower-layer config types under the YAML names users write. Each field is declared once, in its
owner (``workers.config.CacheConfig.block_size``): ``derived_section`` copies the owner's type and
default into a frozen dataclass, and ``check_derived`` validates a built section by constructing
each owner from its fields, so the owner's own ``__post_init__`` checks run and its message is
renamed to the dotted YAML key (cluster/config/sources.py ``lower_error``).

Worked example::

    EngineSection = derived_section("EngineSection", "...", [
        ("block_size", Part(CacheConfig, "block_size")),          # type int, default 16, from CacheConfig
        ("max_num_seqs", Part(SchedulerConfig, "max_num_seqs")),
    ])
    # pools[0].engine.block_size=24 (from duet.yaml): must be a power of two >= 1   (CacheConfig's check)
    owner_kwargs(section, CacheConfig)   # {"block_size": 24}: what to build the worker config from
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.config.sources import KeyMap, Sources, is_lower_config_error, lower_error


@dataclass(frozen=True)
class Part:
    """A section field that is ``owner``'s field ``name`` (its type, default and checks)."""

    owner: type
    name: str


OwnField = tuple[Any, dataclasses.Field]  # (type, dataclasses.field(...)) of a section's own field


def derived_section(name: str, doc: str, fields: Sequence[tuple[str, Part | OwnField]], *,
                    namespace: Mapping[str, Any] | None = None,
                    probe: Mapping[type, Mapping[str, Any]] | None = None) -> type:
    """A frozen dataclass ``name`` whose fields are ``fields`` in order: a ``Part`` takes its type and
    default from the owner; an ``OwnField`` is the section's own. probe: values an owner needs to be
    built for validation that the section does not carry (e.g. RouterConfig's tokenizer_path)."""
    specs, parts = [], {}
    for field_name, spec in fields:
        if isinstance(spec, Part):
            owner_field = {f.name: f for f in dataclasses.fields(spec.owner)}[spec.name]
            hint = typing.get_type_hints(spec.owner)[spec.name]
            same = dict(hash=owner_field.hash, compare=owner_field.compare)
            default = (dataclasses.field(default_factory=owner_field.default_factory, **same)
                       if owner_field.default_factory is not dataclasses.MISSING
                       else dataclasses.field(default=owner_field.default, **same))
            specs.append((field_name, hint, default))
            parts[field_name] = spec
        else:
            specs.append((field_name, *spec))
    ns = dict(namespace or {})
    ns.update(__doc__=doc, PARTS=parts, PROBE=dict(probe or {}))
    cls = dataclasses.make_dataclass(name, specs, frozen=True, namespace=ns)
    cls.__module__ = "cluster.config.duet"  # where it is defined as a module attribute (pickling, messages)
    return cls


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
