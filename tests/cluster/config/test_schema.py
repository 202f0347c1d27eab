"""The settings read off the config models (cluster/config/schema.py): the generated settings
reference, the chart's values.schema.json and its README table match what the models say; every
setting is described; each env var and flag names a real key; and every constraint the JSON schema
states for a lower type's field (HINTS) is the one that type checks in code."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.config.duet import SWITCHES, ClusterConfigError, load_config
from cluster.config.schema import CHART_KEYS, HINTS, generated, settings


def test_generated_files_match_the_models():
    """Fails when a setting changed without `make settings` (python -m cluster.config.schema --write)."""
    for path, text in generated().items():
        assert path.is_file() and path.read_text() == text, f"{path} is stale: run `make settings`"


def test_every_setting_is_described_and_every_switch_and_chart_key_is_a_setting():
    rows = {s.key: s for s in settings()}
    assert [k for k, s in rows.items() if not s.description.strip()] == []
    assert {"model.name", "pools[].engine.block_size", "pools[].speculative.method", "router.port",
            "autoscaling.pools[].slo_tpot_ms", "controller.port"} <= rows.keys()
    envs = {s.env for s in rows.values() if s.env}
    assert {sw.env for sw in SWITCHES.values() if sw.env} == envs  # each declared env var lands on a row
    assert {sw.flag for sw in SWITCHES.values() if sw.flag} == {s.flag for s in rows.values() if s.flag}
    assert {key for key, _ in CHART_KEYS.values()} <= rows.keys()
    assert set(HINTS) <= rows.keys()
    assert rows["pools[].replicas"].env == "DUET_REPLICAS" and rows["router.port"].flag == "--port"
    assert rows["pools[].engine.kv_cache_memory_bytes"].default == 1 << 30


# values a hint's accepted value needs beside it (a draft model for method draft_model, GPUs for cuda)
COMPANIONS: dict[str, dict[str, Any]] = {
    "pools[].speculative.method": {"pool.speculative.draft_model": "/m/d"},
    "pools[].speculative.draft_model": {"pool.speculative.method": "draft_model"},
    "pools[].engine.device": {"pool.gpus_per_rank": 1},
    "pools[].speculative.drafter_device": {"pool.gpus_per_rank": 1},
}


def _loads(key: str, value: Any) -> bool:
    overrides = {key.replace("pools[].", "pool."): value, **COMPANIONS.get(key, {})}
    try:
        load_config(env={}, overrides=overrides)
    except ClusterConfigError:
        return False
    return True


def _probes(schema: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(value, whether the schema allows it) around each bound the schema states."""
    integer = "integer" in schema.get("type", [])
    step = 1 if integer else 0.5
    out: list[tuple[Any, bool]] = []
    if "enum" in schema:
        out += [(v, True) for v in schema["enum"]]
        out.append((3 if integer else "not-one-of-them", False))
    if "minimum" in schema:
        out += [(schema["minimum"], True), (schema["minimum"] - step, False)]
    if "maximum" in schema:
        out += [(schema["maximum"], True), (schema["maximum"] + step, False)]
    if "exclusiveMinimum" in schema:
        out += [(schema["exclusiveMinimum"], False), (schema["exclusiveMinimum"] + step / 10, True)]
    if "exclusiveMaximum" in schema:
        out.append((schema["exclusiveMaximum"], False))
    if "minLength" in schema:
        out.append(("", False))
    if "pattern" in schema:  # a device, or a byte count with a unit
        out += [("cuda:1", True), ("gpu", False)] if "cuda" in schema["pattern"] else [("4MiB", True), ("lots", False)]
    if "anyOf" in schema:  # draft_vocab_size: 0 or >= MIN_DRAFT_VOCAB
        low = schema["anyOf"][1]["minimum"]
        out += [(0, True), (low, True), (low - 1, False)]
    return out


@pytest.mark.parametrize("key", sorted(k for k in HINTS if "drafter_resources" not in k))
def test_each_schema_hint_is_what_the_owner_checks(key):
    rows = {s.key: s for s in settings()}
    probes = _probes(rows[key].schema)
    assert probes, f"{key}: no probe for {rows[key].schema}"
    wrong = [(value, allowed) for value, allowed in probes if _loads(key, value) != allowed]
    assert wrong == [], f"{key}: the schema and the config disagree on {wrong}"


def test_drafter_resources_schema_is_what_the_owner_checks(tmp_path):
    node = {s.key: s for s in settings()}["pools[].speculative.drafter_resources"].schema
    assert node["type"] == "object" and node["additionalProperties"]["exclusiveMinimum"] == 0
    path = tmp_path / "duet.yaml"
    for amount, allowed in ((1, True), (0.5, True), (0, False)):
        path.write_text(f"ray: {{address: auto}}\npools: [{{speculative: {{drafter_resources: {{d: {amount}}}}}}}]\n")
        try:
            load_config(path, env={})
            loaded = True
        except ClusterConfigError:
            loaded = False
        assert loaded == allowed, amount


def test_serve_flags_and_their_help_come_from_the_settings():
    from cluster.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    actions = {flag: a for a in serve._actions for flag in a.option_strings}
    for key, switch in SWITCHES.items():
        if switch.flag:
            action = actions[switch.flag]
            assert action.dest == key and action.default is None  # unset flags leave the key to file/env/default
            assert f"[{switch.env}]" in action.help, switch.flag
    assert actions["--replicas"].help.startswith("the first pool: ")
