"""Where config values come from, and how plain data becomes typed, checked config objects.

Terms:
    dotted key  a value's address: ``router.port``, ``pools[0].engine.block_size``; ``pool.x`` is
                an alias of ``pools[0].x`` (env and flags address the one pool that way).
    sources     dotted key -> where its value came from ("duet.yaml", "env DUET_PORT",
                "flag --port"); every error message quotes it, so the user knows what to edit.

``build`` turns nested dicts (YAML, or values set with ``set_key``) into frozen dataclasses:
strings from env and flags are parsed per field type (``int``, ``float``, ``bool``, ``str``,
``X | None``, nested dataclasses, ``tuple[X, ...]`` from lists, mappings), byte sizes accept units
(``64MiB``, ``1GiB``, ``500MB``) in ``*_bytes`` fields, unknown keys are errors listing the known
ones, and each class's check function (``checks[cls]``) runs once its fields are built.
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
    obj = cls(**kwargs)
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
