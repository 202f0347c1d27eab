"""Where config values come from (the YAML / env / flag layers), and the errors that say so.

Terms:
    dotted key  a value's address: ``router.port``, ``pools[0].engine.block_size``; ``pool.x`` is
                an alias of ``pools[0].x`` (env and flags address the one pool that way).
    layer       one source's values as nested plain data: the YAML file (pydantic-settings'
                ``YamlConfigSettingsSource``), the environment (the variables the settings
                declare, cluster/config/duet.py ``SWITCHES``) and the flags (each a ``KeySource``).
    sources     dotted key -> where its value came from ("duet.yaml", "env DUET_PORT",
                "flag --port"); every error message quotes it, so the user knows what to edit.

``merge`` lays the layers over each other (later wins; lists merge element by element, so
``--replicas`` sizes pools[0] and leaves the YAML's other pools alone); pydantic validates the result
once (cluster/config/duet.py), and ``validation_error`` turns its first error into one line naming
the dotted key, the value as given, its source and what to change. A lower layer's config type
(``workers.config.SpeculativeConfig``) validates itself in ``__post_init__``; its ``ConfigError`` /
``RouterConfigError`` becomes a ClusterConfigError naming the dotted key (``lower_error``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import PydanticBaseSettingsSource, YamlConfigSettingsSource

Sources = dict[str, str]


class ClusterConfigError(ValueError):
    """The configuration is invalid; the message names the key, its source and the fix."""


# ---------------------------------------------------------------------------------- layers
def read_yaml(settings: type[BaseModel], path: Path) -> dict[str, Any]:
    """The YAML file's values (pydantic-settings' YAML source), or a ClusterConfigError naming the file."""
    try:
        path.read_bytes()
    except OSError as e:
        raise ClusterConfigError(f"config file {path}: cannot be read ({e.strerror}); check --config") from None
    try:
        data = YamlConfigSettingsSource(settings, yaml_file=path)()  # type: ignore[arg-type]
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"config file {path}: not valid YAML ({e})") from None
    except (AttributeError, TypeError):  # a top-level list or scalar
        data = None
    if not isinstance(data, dict):
        raise ClusterConfigError(f"config file {path}: must be a mapping of sections (model, pools, router, "
                                 f"ray, controller, autoscaling)")
    return data


class KeySource(PydanticBaseSettingsSource):
    """A layer of values addressed by dotted keys: the environment's or the flags' (``load_config``).
    values: (dotted key, value, where it came from) in order; ``sources`` gets each key's origin."""

    def __init__(self, settings: type[BaseModel], values: Iterable[tuple[str, Any, str]]) -> None:
        super().__init__(settings)  # type: ignore[arg-type]
        self.values, self.sources = list(values), cast(dict[str, str], {})

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # per-field API: unused
        raise NotImplementedError

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value, source in self.values:
            set_key(out, key, value, self.sources, source)
        return out


def set_key(raw: dict[str, Any], key: str, value: Any, sources: Sources, source: str) -> None:
    """Put ``value`` at dotted ``key`` of nested plain data (lists grow as needed)."""
    key = canonical(key)
    sources[key] = source
    node: Any = raw
    parts = _path(key)
    for part, nxt in zip(parts, parts[1:]):
        if isinstance(part, int):
            node.extend({} for _ in range(part + 1 - len(node)))
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    node[parts[-1]] = value


def merge(base: Any, over: Any) -> Any:
    """``over`` laid on ``base``: mappings merge key by key and lists element by element (a list
    element that is a mapping merges too); anything else in ``over`` replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in over.items()}}
    if isinstance(base, list) and isinstance(over, list):
        return [merge(b, o) for b, o in zip(base, over)] + base[len(over):] + over[len(base):]
    return over


def mark_sources(node: Any, prefix: str, source: str, sources: Sources) -> None:
    """Record ``source`` for every key of a YAML tree (``pools[0].engine.block_size``)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        key = f"{prefix}[{k}]" if isinstance(k, int) else f"{prefix}.{k}" if prefix else str(k)
        sources[canonical(key)] = source
        mark_sources(v, key, source, sources)


def canonical(key: str) -> str:
    return "pools[0]" + key[4:] if key == "pool" or key.startswith("pool.") else key


def _path(key: str) -> list[str | int]:
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", key)]


# ---------------------------------------------------------------------------------- messages
def source_of(key: str, sources: Sources) -> str:
    probe = key
    while probe:
        if probe in sources:
            return f"from {sources[probe]}"
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""
    return "default"


def error(key: str, value: Any, sources: Sources, what: str) -> ClusterConfigError:
    return ClusterConfigError(f"{key}={value!r} ({source_of(key, sources)}): {what}")


def need(ok: bool, key: str, value: Any, sources: Sources, what: str) -> None:
    if not ok:
        raise error(key, value, sources, what)


# pydantic's error types -> what to change (the rest keep pydantic's own message)
_PHRASES = {
    "int_parsing": "must be an integer", "int_type": "must be an integer", "int_from_float": "must be an integer",
    "float_parsing": "must be a number", "float_type": "must be a number", "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false", "bool_type": "must be true or false", "string_type": "must be a string",
    "dict_type": "must be a mapping", "model_type": "must be a mapping", "dataclass_type": "must be a mapping",
    "list_type": "must be a list", "tuple_type": "must be a list", "missing": "is required",
    "byte_size": "must be a number of bytes or a size such as 64MiB, 1GiB, 500MB",
    "byte_size_unit": "must be a number of bytes or a size such as 64MiB, 1GiB, 500MB",
}
_CONSTRAINTS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def validation_error(e: ValidationError, model: type[BaseModel], sources: Sources) -> ClusterConfigError:
    """The ClusterConfigError for pydantic's first error in validating ``model`` (module docstring)."""
    err = e.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if not _is_tag(p)]
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    kind, value = err["type"], err["input"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent, _, _ = key.rpartition(".")
        known = ", ".join(_fields(model, loc[:-1]))
        return ClusterConfigError(f"{key} ({source_of(key, sources)}): unknown key in {parent or 'the config'}; "
                                  f"known keys: {known}")
    if kind == "value_error" and is_lower_config_error(err.get("ctx", {}).get("error")):
        keymap = {n: (f"{key}.{n}", None) for n in _fields(model, loc)}
        return lower_error(err["ctx"]["error"], keymap, sources, getattr(_node(model, loc), "KEY_PREFIX", ""))
    hint = _hint(model, loc)
    if kind == "literal_error":
        what = hint or "must be one of " + err["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
    elif kind in _CONSTRAINTS:
        bound = next(iter(err["ctx"].values()))
        what = hint or f"must be {_CONSTRAINTS[kind]} {bound}"
    elif kind in ("string_pattern_mismatch", "string_too_short"):
        what = hint or err["msg"]
    else:
        what = _PHRASES.get(kind) or err["msg"]
    return error(key, value, sources, what)


def _is_tag(part: Any) -> bool:
    """A part of pydantic's error location that names a validator or a union member, not a key."""
    return isinstance(part, str) and (part in ("int", "float", "str", "bool", "none") or bool(re.search(r"[\[\]-]", part)))


def _node(model: Any, loc: list[Any]) -> Any:
    """The type at ``loc`` under ``model`` (a pydantic model, a dataclass, or None when unknown)."""
    tp: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(part)
            tp = field.annotation if field else None
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
        else:
            return None
        while typing.get_origin(tp) in (typing.Union, types.UnionType, tuple, typing.Annotated):
            args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
            tp = args[0] if args else None
    return tp


def _fields(model: type[BaseModel], loc: list[Any]) -> list[str]:
    tp = _node(model, loc)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []


def _hint(model: type[BaseModel], loc: list[Any]) -> str | None:
    """A field's own wording for a refused value (``json_schema_extra={"hint": ...}``)."""
    parent = _node(model, loc[:-1])
    if isinstance(parent, type) and issubclass(parent, BaseModel) and isinstance(loc[-1], str):
        field = parent.model_fields.get(loc[-1])
        extra = field.json_schema_extra if field else None
        return extra.get("hint") if isinstance(extra, dict) else None  # type: ignore[return-value]
    return None


# ---------------------------------------------------------------------------------- lower layers' errors
def is_lower_config_error(e: BaseException | None) -> bool:
    """A config error raised by a worker or router config type's own validation."""
    from router.config import RouterConfigError  # pure Python
    from workers.errors import ConfigError

    return isinstance(e, (ConfigError, RouterConfigError))


KeyMap = Mapping[str, tuple[str, Any]]  # a lower type's key (as its messages spell it) -> (dotted key, value)


def lower_error(e: BaseException, keymap: KeyMap, sources: Sources, message_prefix: str = "") -> ClusterConfigError:
    """The ClusterConfigError for a lower config type's error ``e``.

    The lower types' messages start with ``<key>=<value>: `` (workers/config.py, router/config.py),
    their keys spelled from that type (``speculative.method``, ``cache.block_size``, ``port``);
    ``message_prefix`` is what the type puts before its own field names (``speculative.``).
    Every such key in the message becomes its dotted key here (a dotted key wherever it appears, a
    bare field name where it is followed by ``=``), and the first one gets its source::

        speculative.ngram_min=5, ngram_max=4: need 1 <= ngram_min <= ngram_max
        -> pools[0].speculative.ngram_min=5 (from duet.yaml), pools[0].speculative.ngram_max=4: need ...
    """
    names: dict[str, tuple[str, Any]] = {}
    for key, target in keymap.items():
        names[key] = target
        if message_prefix and not key.startswith(message_prefix):
            names[message_prefix + key] = target
    by_length = sorted(names, key=len, reverse=True)
    dotted = [re.escape(k) for k in by_length if "." in k]
    bare = [re.escape(k) for k in by_length if "." not in k]
    parts = []
    if dotted:
        parts.append(rf"(?<![\w.\[\]'\"])(?:{'|'.join(dotted)})(?![\w])")
    if bare:
        parts.append(rf"(?<![\w.\[\]'\"])(?:{'|'.join(bare)})(?==)")
    message = str(e)
    if parts:
        message = re.sub("|".join(parts), lambda m: names[m.group(0)][0], message)
    lead = re.match(r"([\w.\[\]]+)=", message)
    if lead is None:
        target = next(iter(keymap.values()), ("the config", None))
        return ClusterConfigError(f"{target[0]} ({source_of(target[0], sources)}): {message}")
    key = lead.group(1)
    end = _value_end(message, lead.end())
    return ClusterConfigError(f"{message[:end]} ({source_of(key, sources)}){message[end:]}")


def _value_end(text: str, start: int) -> int:
    """Where the value written at ``text[start:]`` ends: at the first ',', ':' or ' ' outside
    brackets and quotes (values are Python reprs: 'a', 5, {'drafter': 0.0}, (1, 2))."""
    depth, quote = 0, ""
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in ",: ":
            return i
    return len(text)
