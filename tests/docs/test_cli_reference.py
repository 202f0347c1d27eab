"""docs/reference/cli.md is the ``duet`` command's help, generated from its parsers (cluster/cli.py
``build_parser``; ``duet bench`` and ``duet profile`` own theirs in cluster/bench/). The test fails
when the page and the parsers drift; ``python tests/docs/test_cli_reference.py`` rewrites the page."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "cli.md"
WIDTH = "100"  # argparse wraps help at $COLUMNS

HEADER = """# CLI reference

The `duet` command (`cluster/cli.py`; installed by `pip install -e .` as `.venv/bin/duet`). Settings
for `duet serve` and `duet router` come from defaults < a YAML file (`--config`, `$DUET_CONFIG`) <
environment variables < these flags ([Configuration](../serving/configuration.md)); the `[DUET_*]` at
the end of a flag's help names its environment variable.

This page is generated from the parsers by `python tests/docs/test_cli_reference.py`; do not edit it
by hand.
"""


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from cluster.bench import profiler, serving
    from cluster.cli import build_parser

    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    own = {"bench": serving.build_parser(), "profile": profiler.build_parser()}
    return [("duet", root)] + [(f"duet {name}", own.get(name, p)) for name, p in sub.choices.items()]


def render() -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        sections = [f"## `{name}`\n\n```text\n{p.format_help().rstrip()}\n```\n" for name, p in parsers()]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return HEADER + "\n" + "\n".join(sections)


def test_cli_reference_matches_the_parsers():
    assert PAGE.read_text(encoding="utf-8") == render(), \
        "docs/reference/cli.md is stale: run `python tests/docs/test_cli_reference.py` and commit it"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
