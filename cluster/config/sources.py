"""Where config values come from, and how plain data becomes typed, checked config objects.

Terms:
    dotted key  a value's address: ``router.port``, ``pools[0].engine.block_size``; ``pool.x`` is
                an alias of ``pools[0].x`` (env and flags address the one pool that way).
    sources     dotted key -> where its value came from ("duet.yaml", "env DUET_PORT",
                "flag --port"); every error message quotes it, so the user knows what to edit.

``build`` turns nested dicts (YAML, or values set with ``set_key``) into frozen dataclasses:
strings from env and flags are parsed per field type (``int``, ``float``, ``bool``, ``str``,
``X | None``, nested dataclasses, ``tuple[X, ...]`` from lists, mappings, and
``tuple[tuple[str, float], ...]`` from a mapping), byte sizes accept units (``64MiB``, ``1GiB``,
``500MB``) in ``*_bytes`` fields, unknown keys are errors listing the known ones, and each class's
check function (``checks[cls]``) runs once its fields are built. A lower layer's config type used as
a section (``workers.config.SpeculativeConfig``) validates itself in ``__post_init__``; its
``ConfigError`` / ``RouterConfigError`` becomes a ClusterConfigError naming the dotted key
(``lower_error``). cluster/config/derive.py builds sections from several lower types.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

Sources = dict[str, str]
Checks = Mapping[type, Callable[[Any, str, Sources], None]]


class ClusterConfigError(ValueError):
    """The configuration is invalid; the message names the key, its source and the fix."""


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ClusterConfigError(f"config file {path}: cannot be read ({e.strerror}); check --config") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"config file {path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ClusterConfigError(f"config file {path}: must be a mapping of sections (model, pools, router, "
                                 f"ray, controller), not {type(data).__name__}")
    return data


def mark_sources(node: Any, prefix: str, source: str, sources: Sources) -> None:
    """Record ``source`` for every key of a YAML tree (``pools[0].engine.block_size``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            sources[_canonical(key)] = source
            mark_sources(v, key, source, sources)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            sources[f"{prefix}[{i}]"] = source
            mark_sources(v, f"{prefix}[{i}]", source, sources)


def _canonical(key: str) -> str:
    return "pools[0]" + key[4:] if key == "pool" or key.startswith("pool.") else key


def set_key(raw: dict[str, Any], key: str, value: Any, sources: Sources, source: str) -> None:
    key = _canonical(key)
    sources[key] = source
    parts = key.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        name, index = _split_index(part)
        if index is None:
            child = node.setdefault(name, {})
        else:
            lst = node.setdefault(name, [])
            if not isinstance(lst, list):
                raise ClusterConfigError(f"{name}: must be a list of pools ({source} sets {key})")
            while len(lst) <= index:
                lst.append({})
            child = lst[index]
        if not isinstance(child, dict):
            raise ClusterConfigError(f"{'.'.join(parts[:i + 1])}: must be a mapping ({source} sets {key})")
        node = child
    node[parts[-1]] = value


def _split_index(part: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(\w+)\[(\d+)\]", part)
    return (m.group(1), int(m.group(2))) if m else (part, None)


# ---------------------------------------------------------------------------------- build + validate
def build(cls: type, data: Any, prefix: str, sources: Sources, checks: Checks) -> Any:
    """Construct dataclass ``cls`` from plain ``data`` (converting and checking every field, then
    running ``checks[cls]``); ``prefix`` is its dotted key."""
    where = prefix or "the config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(prefix, data, sources, "must be a mapping")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ClusterConfigError(f"{key} ({source_of(key, sources)}): unknown key in {where}; "
                                 f"known keys: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            key = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _convert(hints[name], data[name], key, sources, checks)
    try:
        obj = cls(**kwargs)
    except ValueError as e:  # a lower layer's own validation (workers.config, router.config)
        if not is_lower_config_error(e):
            raise
        values = {f.name: kwargs.get(f.name, f.default) for f in dataclasses.fields(cls)}
        raise lower_error(e, {k: (f"{prefix}.{k}" if prefix else k, v) for k, v in values.items()},
                          sources, message_prefix=getattr(cls, "KEY_PREFIX", "")) from None
    check = checks.get(cls)
    if check is not None:
        check(obj, prefix, sources)
    return obj


def _convert(tp: Any, value: Any, key: str, sources: Sources, checks: Checks) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none")):
            if type(None) in args:
                return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, sources, checks)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key, sources, checks)
    if origin is tuple and args[0] == tuple[str, float]:  # resource amounts: a mapping in YAML
        if not isinstance(value, dict):
            raise error(key, value, sources, "must be a mapping of names to amounts, e.g. {drafter: 1}")
        return tuple(sorted((str(k), _convert(float, v, f"{key}.{k}", sources, checks)) for k, v in value.items()))
    if origin is tuple:  # tuple[PoolSection, ...]; an empty list is () (class checks require entries)
        if not isinstance(value, list):
            raise error(key, value, sources, "must be a list")
        return tuple(_convert(args[0], v, f"{key}[{i}]", sources, checks) for i, v in enumerate(value))
    if tp is Mapping[str, Any] or origin is Mapping:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise error(key, value, sources, "must be a mapping of option names to values")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.strip().lower() in ("true", "1", "yes", "on")
        raise error(key, value, sources, "must be true or false")
    if tp is int:
        return _to_int(value, key, sources)
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            result = float(value)
        except (TypeError, ValueError):
            raise error(key, value, sources, "must be a number") from None
        if not math.isfinite(result):
            raise error(key, value, sources, "must be a finite number")
        return result
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise error(key, value, sources, "must be a string")
        return str(value)
    raise AssertionError(f"no converter for {tp!r} ({key})")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _to_int(value: Any, key: str, sources: Sources) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        m = re.fullmatch(r"(-?\d+)\s*([a-zA-Z]*)", text)
        if m and m.group(2).lower() in _UNITS and (not m.group(2) or key.endswith("_bytes")):
            return int(m.group(1)) * _UNITS[m.group(2).lower()]
    hint = " (or a size such as 64MiB, 1GiB, 500MB)" if key.endswith("_bytes") else ""
    raise error(key, value, sources, f"must be an integer{hint}")


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


# ---------------------------------------------------------------------------------- lower layers' errors
def is_lower_config_error(e: BaseException) -> bool:
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
