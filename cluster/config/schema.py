"""Every setting as one row (key, type, default, env var, flag, description, JSON schema), read off
the config models (cluster/config/duet.py), and what is generated from the rows:

    docs/reference/settings.md          the settings reference
    deploy/helm/duet/values.schema.json the chart values that feed the Duet config (``CHART_KEYS``);
                                        the chart's own values (image, pods, network) are edited there
                                        by hand and kept as they are
    deploy/helm/duet/README.md          its values table (between the values-table markers)
    ``duet serve --help``               each flag's help (cluster/cli.py)

``python -m cluster.config.schema --write`` (``make settings``) writes the files; ``--check`` fails
when a committed file differs from what the models say (tests/cluster/config/test_schema.py too).

Constraints a lower config type checks in code (``workers.config.CacheConfig.block_size`` is a
power of two) are stated for the JSON schema in ``HINTS``; test_schema.py checks each one against
the owner's own check (a value the hint allows loads, one it refuses does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter

from cluster.config.derive import field_docs
from cluster.config.duet import SWITCHES, DuetConfig
from router.policies import POLICIES
from router.policies.drafter import DRAFTER_POLICIES
from workers.config import (COMM_MODES, DRAFTER_DEVICES, DTYPES, KV_BACKENDS, MIN_DRAFT_VOCAB, OMP_WAIT_POLICIES, QUANTIZED_BATCHES,
                            QUANTIZATIONS, SPEC_METHODS)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "reference" / "settings.md"
CHART = ROOT / "deploy" / "helm" / "duet"
TABLE_BEGIN, TABLE_END = "<!-- values-table:begin -->", "<!-- values-table:end -->"

_SIZE = {"minimum": 1}
HINTS: dict[str, dict[str, Any]] = {
    "model.name": {"minLength": 1},
    "model.dtype": {"enum": ["auto", *DTYPES]},
    "model.max_model_len": {"minimum": 2},
    "model.quantization": {"enum": list(QUANTIZATIONS)},
    "pools[].engine.block_size": {"enum": [1 << i for i in range(11)]},
    "pools[].engine.max_num_batched_tokens": _SIZE,
    "pools[].engine.max_num_seqs": _SIZE,
    "pools[].engine.device": {"pattern": "^(auto|cpu|cuda(:[0-9]+)?)$"},
    "pools[].engine.kv_transfer_backend": {"enum": list(KV_BACKENDS)},
    "pools[].engine.target_itl_ms": {"exclusiveMinimum": 0},
    "pools[].engine.omp_wait_policy": {"enum": list(OMP_WAIT_POLICIES)},
    "pools[].engine.niceness": {"minimum": -20, "maximum": 19},
    "pools[].engine.lora.max_loaded": {"minimum": 1, "maximum": 256},
    "pools[].engine.lora.max_rank": {"minimum": 1, "maximum": 256},
    "pools[].engine.quantized_batches": {"enum": list(QUANTIZED_BATCHES)},
    "pools[].ep_size": _SIZE, "pools[].sp_size": _SIZE, "pools[].tp_size": _SIZE,
    "pools[].comm": {"enum": list(COMM_MODES)},
    "pools[].speculative.method": {"enum": list(SPEC_METHODS)},
    "pools[].speculative.num_speculative_tokens": {"minimum": 1, "maximum": 16},
    "pools[].speculative.ngram_min": _SIZE, "pools[].speculative.ngram_max": _SIZE,
    "pools[].speculative.draft_model": {"minLength": 1},
    "pools[].speculative.draft_quantization": {"enum": list(QUANTIZATIONS)},
    "pools[].speculative.drafter_cpus": _SIZE,
    "pools[].speculative.drafter_resources": {"type": "object",
                                              "additionalProperties": {"type": "number", "exclusiveMinimum": 0}},
    "pools[].speculative.draft_timeout_s": {"exclusiveMinimum": 0},
    "pools[].speculative.draft_vocab_size": {"anyOf": [{"const": 0}, {"minimum": MIN_DRAFT_VOCAB}]},
    "pools[].speculative.drafter_threads": {"minimum": 0},
    "pools[].speculative.drafter_device": {"enum": list(DRAFTER_DEVICES)},
    "pools[].drafter.model": {"minLength": 1},
    "pools[].drafter.quantization": {"enum": list(QUANTIZATIONS)},
    "pools[].drafter.threads": {"minimum": 0},
    "pools[].drafter.draft_vocab_size": {"anyOf": [{"const": 0}, {"minimum": MIN_DRAFT_VOCAB}]},
    "pools[].drafter.idle_timeout_s": {"exclusiveMinimum": 0},
    "router.host": {"minLength": 1},
    "router.port": {"minimum": 0, "maximum": 65535},
    "router.http_port": {"minimum": 0, "maximum": 65535},
    "router.policy": {"enum": list(POLICIES)},
    "router.drafter_policy": {"enum": list(DRAFTER_POLICIES)},
    "router.max_in_flight": _SIZE,
    "router.max_queue": {"minimum": 0},
    "router.shutdown_grace_s": {"minimum": 0},
    "router.max_request_bytes": {"minimum": 1024},
    "router.disagg_min_prompt_tokens": {"minimum": 0},
    "router.prefix_pull_min_tokens": {"minimum": 0},
    "router.rebalance_interval_s": {"exclusiveMinimum": 0},
    "router.rebalance_kv_gap": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "router.rebalance_tpot_ratio": {"exclusiveMinimum": 1},
    "router.rebalance_request_cooldown_s": {"exclusiveMinimum": 0},
}

# chart value (its path in values.yaml; "pool." = pools[] and poolDefaults alike) -> the config key
# it feeds (templates/_config.tpl) and what the chart narrows further.
_POOL = {"replicas": "replicas", "standbyReplicas": "standby_replicas", "standbyLoad": "standby_load", "epSize": "ep_size", "spSize": "sp_size", "tpSize": "tp_size",
         "placementStrategy": "placement_strategy", "maxRestarts": "max_restarts",
         **{f"engine.{k}": f"engine.{v}" for k, v in (
             ("blockSize", "block_size"), ("kvCacheMemory", "kv_cache_memory_bytes"),
             ("maxNumBatchedTokens", "max_num_batched_tokens"), ("maxNumSeqs", "max_num_seqs"),
             ("enablePrefixCaching", "enable_prefix_caching"), ("device", "device"), ("cudaGraphs", "cuda_graphs"),
             ("hostTierMemory", "host_tier_bytes"), ("diskTierSize", "disk_tier_bytes"),
             ("hostTierShared", "host_tier_shared"),
             ("tierLoadTimeoutSeconds", "tier_load_timeout_s"), ("tierPolicy", "tier_policy"),
             ("kvCacheDtype", "kv_cache_dtype"),
             ("lora.enabled", "lora.enabled"),
             ("lora.maxLoaded", "lora.max_loaded"), ("lora.maxRank", "lora.max_rank"))},
         **{f"speculative.{k}": f"speculative.{v}" for k, v in (
             ("method", "method"), ("numSpeculativeTokens", "num_speculative_tokens"), ("adaptive", "adaptive"),
             ("ngramMin", "ngram_min"), ("ngramMax", "ngram_max"), ("draftModel", "draft_model"),
             ("draftQuantization", "draft_quantization"), ("drafterDevice", "drafter_device"),
             ("drafterCpus", "drafter_cpus"), ("draftTimeoutSeconds", "draft_timeout_s"), ("overlap", "overlap"),
             ("drafterPool", "drafter_pool"))},
         **{f"drafter.{k}": f"drafter.{v}" for k, v in (
             ("model", "model"), ("quantization", "quantization"), ("threads", "threads"),
             ("idleTimeoutSeconds", "idle_timeout_s"))}}
CHART_KEYS: dict[str, tuple[str, dict[str, Any]]] = {
    "model.name": ("model.name", {}), "model.dtype": ("model.dtype", {}),
    "model.maxModelLen": ("model.max_model_len", {}), "model.quantization": ("model.quantization", {}),
    "model.adapterDir": ("model.adapter_dir", {}), "pool.model": ("pools[].model", {}),
    "rayNamespace": ("ray.namespace", {}),
    "head.controller.pollIntervalSeconds": ("controller.poll_interval_s", {}),
    "head.controller.startTimeoutSeconds": ("controller.start_timeout_s", {}),
    "head.controller.port": ("controller.port", {"minimum": 1}),  # routers in other pods need a fixed port
    "autoscaling.duet.enabled": ("autoscaling.enabled", {}), "autoscaling.duet.actuator": ("autoscaling.actuator", {}),
    "autoscaling.duet.intervalSeconds": ("autoscaling.interval_s", {}),
    "autoscaling.duet.drainGraceSeconds": ("autoscaling.drain_grace_s", {}),
    "autoscaling.duet.downCooldownSeconds": ("autoscaling.down_cooldown_s", {}),
    "router.port": ("router.port", {}), "router.httpPort": ("router.http_port", {}),
    "router.policy": ("router.policy", {}), "router.policyOptions": ("router.policy_options", {}),
    "router.maxInFlight": ("router.max_in_flight", {}), "router.maxQueue": ("router.max_queue", {}),
    "router.shutdownGraceSeconds": ("router.shutdown_grace_s", {}),
    "router.wakeTimeoutSeconds": ("router.wake_timeout_s", {}),
    "autoscaling.duet.scaleToZeroAfterSeconds": ("autoscaling.scale_to_zero_after_s", {}),
    "router.maxRequestBytes": ("router.max_request_bytes", {}),
    # the chart fills maxNumSeqs' default in (64) rather than leaving it to the scheduler
    **{f"pool.{k}": (f"pools[].{v}", {"type": "integer"} if k == "engine.maxNumSeqs" else {}) for k, v in _POOL.items()},
}


REQUIRED = object()  # the default of a key without one (an adapter's name and source): the reference says "required"


@dataclass(frozen=True)
class Setting:
    """One setting. key: its dotted key, ``pools[]`` for every pool's; env / flag: how the edge sets it."""

    key: str
    default: Any
    description: str
    schema: dict[str, Any]
    env: str | None = None
    flag: str | None = None


@functools.cache
def settings() -> tuple[Setting, ...]:
    """Every leaf setting of DuetConfig, in declaration order."""
    edges = {_doc_key(k): s for k, s in SWITCHES.items()}
    rows = []
    for key, default, description, schema in _walk(DuetConfig, ""):
        edge = edges.get(key)
        rows.append(Setting(key, default, description, _finish(schema, HINTS.get(key, {})),
                            edge.env if edge else None, edge.flag if edge else None))
    return tuple(rows)


def _doc_key(switch_key: str) -> str:
    return re.sub(r"^pools\[\*\]|^pool\b", "pools[]", switch_key)


def _walk(model: type, prefix: str) -> typing.Iterator[tuple[str, Any, str, dict[str, Any]]]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        props = model.model_json_schema()["properties"]
        for name, field in model.model_fields.items():
            inner = _section(field.annotation)
            if inner is not None:
                yield from _walk(inner, f"{prefix}{name}{'[]' if _is_list(field.annotation) else ''}.")
            else:
                default = REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
                yield f"{prefix}{name}", _plain(default), field.description or "", props[name]
    else:  # a lower layer's dataclass used as a section (pools[].speculative)
        assert dataclasses.is_dataclass(model), model
        docs, hints = field_docs(model), typing.get_type_hints(model)
        for f in dataclasses.fields(model):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield f"{prefix}{f.name}", _plain(default), docs.get(f.name, ""), TypeAdapter(hints[f.name]).json_schema()


def _section(annotation: Any) -> type | None:
    """The section type a field holds (itself, or the element of a tuple of sections), else None."""
    for tp in (annotation, *typing.get_args(annotation)):
        tp = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
        if isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp)):
            return tp
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is tuple


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return dict(value) if isinstance(value, typing.Mapping) else value


def _finish(schema: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    """One value's JSON schema: pydantic's, with the owner's constraints (``HINTS``) and without
    titles, defaults and descriptions (the rows carry those); ``anyOf [X, null]`` becomes X with null."""
    schema = {k: v for k, v in schema.items() if k not in ("title", "default", "description", "hint")}
    any_of = schema.pop("anyOf", None)
    if any_of:
        nulls = [s for s in any_of if s.get("type") == "null"]
        rest = [s for s in any_of if s.get("type") != "null"]
        if nulls and len(rest) == 1:
            schema.update({k: v for k, v in rest[0].items() if k != "title"})
            types = schema["type"] if isinstance(schema.get("type"), list) else [schema["type"]]
            schema["type"] = [*types, "null"]
        else:
            schema["anyOf"] = any_of
    if "type" in hint:  # a different shape in YAML than in Python (resource pairs as a mapping)
        schema = {"type": [hint["type"], "null"] if "null" in schema.get("type", []) else hint["type"]}
    schema.update({k: v for k, v in hint.items() if k != "type"})
    if "enum" in schema:
        schema.pop("pattern", None)
    return schema


# ---------------------------------------------------------------------------------- the reference
def _type_text(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " \\| ".join(str(v) for v in schema["enum"])
    types = schema.get("type", "any")
    names: dict[Any, Any] = {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "object": "mapping",
             "array": "list", "null": "null"}
    text = " or ".join(str(names.get(t, t)) for t in (types if isinstance(types, list) else [types]))
    if "pattern" in schema and "int" in text:
        return text.replace("int or str", "int or size (64MiB) or auto" if "auto" in schema["pattern"] else "int or size (64MiB)")
    return text


def settings_markdown() -> str:
    lines = ["# Settings reference", "",
             "<!-- Generated by `python -m cluster.config.schema --write` from cluster/config/ (make settings); "
             "do not edit. -->", "",
             "Every key of the Duet config (`duet serve --config duet.yaml`, or `$DUET_CONFIG`), its type and "
             "default, and the environment variable and `duet serve` flag that set it. Precedence, later wins: "
             "defaults < YAML file < environment < flags. `pools[]` keys are per pool; an env var or flag "
             "marked (first pool) sets `pools[0]` only (size the other pools in the YAML file), one marked "
             "(every pool) sets each pool. Check a merged config with `duet serve --dry-run`; "
             "`cluster/duet.example.yaml` is a documented example file.", ""]
    section = None
    for s in settings():
        top = s.key.split(".")[0].split("[")[0]
        if top != section:
            section = top
            doc = (DuetConfig.model_fields[top].description or "").rstrip(".")
            lines += [*([""] if lines[-1] else []), f"## `{top}`", "", f"{doc}.", "", "| key | type | default | env | flag | description |",
                      "|---|---|---|---|---|---|"]
        scope = "" if not s.key.startswith("pools[]") or not (s.env or s.flag) else (
            " (every pool)" if any(k.startswith("pools[*]") and _doc_key(k) == s.key for k in SWITCHES)
            else " (first pool)")
        cells = [f"`{s.key}`", _type_text(s.schema), "required" if s.default is REQUIRED else f"`{json.dumps(s.default)}`",
                 f"`{s.env}`{scope}" if s.env else "", f"`{s.flag}`{scope}" if s.flag else "",
                 s.description.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flag_help(key: str) -> str:
    """``duet serve --help`` text of the flag setting dotted ``key`` (a SWITCHES key)."""
    row = next(s for s in settings() if s.key == _doc_key(key))
    scope = "the first pool: " if key.startswith("pool.") else ""
    text = f"{scope}{row.description} [{row.env}]" if row.env else f"{scope}{row.description}"
    return text.replace("%", "%%")  # argparse formats help with %


# ---------------------------------------------------------------------------------- the chart
def values_schema(current: dict[str, Any]) -> dict[str, Any]:
    """``current`` (the committed values.schema.json) with every CHART_KEYS value regenerated."""
    rows = {s.key: s for s in settings()}
    out = json.loads(json.dumps(current))
    for chart_key, (config_key, narrow) in CHART_KEYS.items():
        row = rows[config_key]
        node = {**row.schema, **narrow, "description": f"{_first_clause(row.description)} (Duet config `{config_key}`)"}
        paths = ([f"pools.items.{chart_key[5:]}", f"poolDefaults.{chart_key[5:]}"] if chart_key.startswith("pool.")
                 else [chart_key])
        for path in paths:
            parent = out
            *parents, leaf = path.split(".")
            for part in parents:
                parent = parent[part] if part == "items" else parent["properties"][part]
            parent["properties"][leaf] = node
    return out


def _first_clause(text: str) -> str:
    """``text`` up to its first '. ' or '; ' outside brackets."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 and ch in ".;" and text[i + 1:i + 2] in (" ", ""):
            text = text[:i]
            break
    return text


def table_rows(schema: dict, values: Any, prefix: str) -> list[tuple[str, str, str]]:
    """(key, default, description) for each leaf: a schema node without properties, or whose
    value in values.yaml is not a non-empty mapping (free-form maps and lists are one row)."""
    rows = []
    for name, node in schema["properties"].items():
        key = f"{prefix}{name}"
        value = values.get(name) if isinstance(values, dict) else None
        if name == "pools" and not prefix:
            rows.append((key, _default(value), node["description"]))
            for sub in ("name", "role"):
                rows.append((f"pools[].{sub}", "", node["items"]["properties"][sub]["description"]))
            rows.append(("pools[].<key>", "", "any poolDefaults key, for this pool only"))
        elif "properties" in node and isinstance(value, dict) and value:
            rows += table_rows(node, value, key + ".")
        else:
            rows.append((key, _default(value) if name in (values or {}) else "", node["description"]))
    return rows


def _default(value: Any) -> str:
    return "`" + json.dumps(value, separators=(", ", ": ")) + "`"


def values_table(schema: dict[str, Any]) -> str:
    """The chart README's values table: a row per leaf of ``schema``, with values.yaml's defaults."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = ["| key | default | description |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {desc.replace('|', chr(92) + '|')} |"
              for key, default, desc in table_rows(schema, values, "")]
    return "\n".join(lines)


def generated() -> dict[Path, str]:
    """Each generated file's path -> the text the models give it."""
    schema_path, readme_path = CHART / "values.schema.json", CHART / "README.md"
    schema = values_schema(json.loads(schema_path.read_text()))
    readme = readme_path.read_text()
    start, end = readme.index(TABLE_BEGIN) + len(TABLE_BEGIN), readme.index(TABLE_END)
    return {DOCS: settings_markdown(), schema_path: json.dumps(schema, indent=2) + "\n",
            readme_path: f"{readme[:start]}\n{values_table(schema)}\n{readme[end:]}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.config.schema", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="write the generated files")
    p.add_argument("--check", action="store_true", help="exit 1 if a committed file differs from the models")
    args = p.parse_args(argv)
    stale = []
    for path, text in generated().items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path)
            if args.write:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in stale:
        print(f"{'wrote' if args.write else 'stale'}: {path.relative_to(ROOT)}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
