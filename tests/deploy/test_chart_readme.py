"""The chart README's values reference against values.yaml and values.schema.json: every value has
a row, no row is stale (key and default are what values.yaml says), and the values the code does
not use yet say so. Regenerate the table with ``python tests/deploy/test_chart_readme.py`` and
paste it between the README's ``<!-- values-table -->`` markers."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from cluster.config.schema import CHART, TABLE_BEGIN, TABLE_END, table_rows
from cluster.config.schema import values_table as schema_values_table

BEGIN, END = TABLE_BEGIN, TABLE_END
NOT_YET_USED: list[str] = []


def values_table() -> str:
    return schema_values_table(json.loads((CHART / "values.schema.json").read_text()))


def _readme_table() -> str:
    text = (CHART / "README.md").read_text()
    assert BEGIN in text and END in text, f"README.md needs the {BEGIN} ... {END} markers"
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def test_every_value_documented_and_no_stale_rows():
    expected = {line.split(" | ")[0]: line for line in values_table().splitlines()[2:]}
    actual = {line.split(" | ")[0]: line for line in _readme_table().splitlines()[2:]}
    missing, stale = sorted(expected.keys() - actual.keys()), sorted(actual.keys() - expected.keys())
    assert not missing and not stale, f"README values table: missing rows {missing}, stale rows {stale}; regenerate it"
    for key, line in expected.items():
        assert actual[key] == line, f"README row {key} is out of date:\n  README: {actual[key]}\n  now:    {line}"


def test_values_the_code_does_not_use_yet_say_so():
    rows = {line.split(" | ")[0].strip("| `"): line for line in _readme_table().splitlines()[2:]}
    for key in NOT_YET_USED:
        assert "not yet used" in rows[key], f"{key}: the README must say it is not yet used"
    notes = (CHART / "templates" / "_config.tpl").read_text()
    # a pool's slo/profile without the rest of what Duet's autoscaler needs is reported in NOTES
    assert "pools[{{ .name }}].slo/profile" in notes


def test_gpus_and_pool_placement_are_no_longer_reported_as_unwired():
    """gpusPerRank reaches gpus_per_rank and each pool's ranks ask for the pool's own Ray resource
    (cluster/deploy/pools.py rank_bundle): neither the README's "Not yet wired" nor NOTES warns about them."""
    readme = (CHART / "README.md").read_text()
    not_wired = readme[readme.index("## Not yet wired"):readme.index("## Values")]
    notes = (CHART / "templates" / "_config.tpl").read_text()
    notes = notes[notes.index('define "duet.notWired"'):notes.index('define "duet.routerSecurityEnv"')]
    notes = re.sub(r"\{\{.*?\}\}", "", notes)  # the messages, not the template logic that picks them
    for text in (not_wired, notes):
        assert "gpusPerRank" not in text and "reserve only CPUs" not in text and "reserve CPUs only" not in text
    rows = {line.split(" | ")[0].strip("| `"): line for line in _readme_table().splitlines()[2:]}
    assert "not yet used" not in rows["poolDefaults.gpusPerRank"]
    assert "duet_pool_<name>" in readme and "numOfHosts" in readme


def test_every_schema_leaf_has_a_row_with_a_description():
    for key, _default_value, description in table_rows(json.loads((CHART / "values.schema.json").read_text()),
                                                  yaml.safe_load((CHART / "values.yaml").read_text()), ""):
        assert description.strip(), f"{key}: no description in values.schema.json"
        assert re.fullmatch(r"[\w.\[\]<>-]+", key), key


def test_a_pool_takes_exactly_the_poolDefaults_keys():
    """The table documents pool settings once, under poolDefaults ("pools[].<key>: any poolDefaults
    key"); that holds only while the schema's pool entry and poolDefaults agree key by key."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    item, defaults = schema["pools"]["items"]["properties"], schema["poolDefaults"]["properties"]

    def without_required(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: without_required(v) for k, v in node.items() if k != "required"}
        return node

    assert set(item) == set(defaults) | {"name", "role"}
    for key, node in defaults.items():
        assert without_required(item[key]) == without_required(node), f"pools[].{key} differs from poolDefaults.{key}"
