"""The prose checked against the code: what README.md, docs/ and the chart README name must exist.

Each check reads the Markdown as text (nothing is rendered) and fails with the file, the line and
the name that does not resolve:

    repo paths      ``workers/engine/engine.py``, ``tests/workers/test_migration_*.py`` (a glob must
                    match), ``cluster/{config,deploy}/`` (braces expand): every path that starts at
                    a top-level folder or names a root file exists. The chart README's own paths
                    (``templates/_config.tpl``, ``ci/*-values.yaml``) resolve from the chart folder.
    module names    ``workers.structured.matcher.rebuild_matcher``, ``python -m benchmarks.disagg_bench``:
                    the longest module prefix exists and the rest is defined in it.
    config keys     ``pools[].engine.device``, ``router.http_port``, ``model.dtype``: a key of the
                    deployment config (cluster/config/), or of the Helm chart's values.schema.json.
    CLI flags       ``duet serve --dry-run``: every flag given to a ``duet`` command is one of its
                    options (cluster/cli.py ``build_parser``).
    make targets    ``make gpu-check``: a target of the Makefile.
    env variables   ``DUET_HTTP_PORT``: read somewhere in the code, the Makefile or the chart.
    config blocks   every fenced ``yaml`` block in docs/ loads with Duet's own config loader
                    (``load_config``); a block whose first line is ``# Helm values`` validates
                    against the chart's values.schema.json instead. Profiles a block names are
                    written as ``duet profile`` writes them (a colocated profile), so an example that
                    needs a profile no command produces fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "duet"
TOP_DIRS = ("workers", "cluster", "router", "kernels", "protos", "benchmarks", "deploy", "tests", "docs")
ROOT_FILES = ("Makefile", "pyproject.toml", "README.md", "mkdocs.yml")
PACKAGES = ("workers", "cluster", "router", "kernels", "protos", "benchmarks")
CONFIG_SECTIONS = ("model", "models", "pools", "pool", "router", "ray", "controller", "autoscaling")
# Inline keys checked: not ``ray.*`` (ray.io, ray.cluster_utils are Ray's own names); YAML blocks check those.
INLINE_SECTIONS = ("models", "model", "pools", "pool", "router", "controller", "autoscaling")
GENERATED = ("benchmarks/results/",)  # outputs the docs name, ignored by git


def doc_files() -> list[Path]:
    return [ROOT / "README.md", CHART / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def _code_spans(text: str) -> list[str]:
    """The contents of inline code spans and fenced blocks of one line (fences are whole lines)."""
    return re.findall(r"`([^`]+)`", text)


# ----------------------------------------------------------------------------------------- paths
_PATH = re.compile(r"(?<![\w./<>$-])((?:%s)/[\w./*{},<>…-]*|(?:%s)(?![\w.-]))" %
                   ("|".join(TOP_DIRS), "|".join(re.escape(f) for f in ROOT_FILES)))


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def mentioned_paths(path: Path) -> Iterator[tuple[int, str]]:
    in_url = re.compile(r"https?://\S+")
    for n, line in _lines(path):
        for m in _PATH.finditer(in_url.sub(" ", line)):
            raw = m.group(1).rstrip(".,:;)…")
            if "<" in raw or ">" in raw:  # a template such as <cache>/models/<name>
                continue
            yield n, raw


def _exists(raw: str, base: Path) -> bool:
    for candidate in _expand(raw):
        for root in (base, ROOT):  # a link relative to the page, or a path from the repository root
            target = root / candidate
            if "*" in candidate:
                if glob.glob(str(target)):
                    return True
            elif target.exists():
                return True
    return False


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repo_path_mentioned_exists(doc: Path):
    base = doc.parent  # links in docs/ pages and the chart's own paths are relative to their folder
    missing = [f"{_where(doc, n)}: {raw}" for n, raw in mentioned_paths(doc)
               if not raw.startswith(GENERATED) and not _exists(raw, base)]
    assert not missing, "paths named in the docs that are not in the repository:\n  " + "\n  ".join(missing)


def _repo_basenames() -> set[str]:
    import subprocess

    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {Path(line).name for line in out.splitlines()}


_BARE_FILE = re.compile(r"^[\w.-]+\.(?:py|proto|cpp|h|tpl|sh)$")  # source files, not the user's (duet.yaml)


def test_every_bare_file_name_in_code_exists_somewhere():
    """`pools.py`, `sim_replica.py`: a file named without its folder still has to exist (any folder)."""
    names = _repo_basenames()
    bad = [f"{_where(doc, n)}: {token}" for doc in doc_files() for n, line in _lines(doc)
           for span in _code_spans(line) for token in span.split()
           if _BARE_FILE.match(token) and "/" not in token and token not in names
           ]
    assert not bad, "file names in the docs that no file in the repository has:\n  " + "\n  ".join(bad)


# --------------------------------------------------------------------------------- module names
_MODULE = re.compile(r"(?<![\w./-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolve_module_name(dotted: str) -> bool | None:
    """True: a module (or a name defined in one); False: a module prefix exists but the rest is not
    defined there; None: only the top-level package matches (may be a config key: router.port)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        file = _module_file(".".join(parts[:i]))
        if file is None:
            continue
        if i == len(parts):
            return True
        if i == 1:
            return True if _defines(file.read_text(encoding="utf-8"), parts[1]) else None
        return _defines(file.read_text(encoding="utf-8"), parts[i])
    return None


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b"
                     rf"|^\s+{name},?$", source, re.MULTILINE) is not None


# ---------------------------------------------------------------------------------- config keys
def _fields(tp: Any) -> dict[str, Any] | None:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(tp)}
    model_fields = getattr(tp, "model_fields", None)  # a pydantic model
    if isinstance(model_fields, dict):
        out = {}
        for name, f in model_fields.items():
            out[name] = f.annotation
            if getattr(f, "alias", None):
                out[f.alias] = f.annotation
        return out
    return None


def _inner_types(annotation: Any) -> list[Any]:
    """The classes a field's annotation may hold (Optional, tuples, lists, Annotated unwrapped)."""
    if _fields(annotation) is not None:
        return [annotation]
    out = []
    for arg in typing.get_args(annotation):
        if arg is not Ellipsis and arg is not type(None):
            out += _inner_types(arg)
    return out


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    if origin in (dict, typing.Mapping) or (isinstance(origin, type) and issubclass(origin, dict)):
        return True
    try:
        from collections.abc import Mapping as AbcMapping
        return isinstance(origin, type) and issubclass(origin, AbcMapping)
    except TypeError:
        return False


def resolve_config_key(key: str) -> bool:
    """Whether a dotted key (``pools[].engine.device``, ``pool.replicas``) is a deployment config key."""
    from cluster.config.duet import DuetConfig

    parts = [re.sub(r"\[\d*\]$", "", p) for p in key.split(".")]
    if parts[0] == "pool":
        parts[0] = "pools"
    types: list[Any] = [DuetConfig]
    for part in parts:
        nxt: list[Any] = []
        for tp in types:
            fields = _fields(tp) or {}
            if part in fields:
                annotation = fields[part]
                if _is_mapping(annotation) or any(_is_mapping(a) for a in typing.get_args(annotation)):
                    return True  # free-form below (resources_per_rank.drafter, policy_options.balance_rel)
                nxt += _inner_types(annotation) or [annotation]
        if not nxt:
            return False
        types = nxt
    return True


def _helm_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def resolve_helm_key(key: str) -> bool:
    node: Any = _helm_schema()
    for part in key.split("."):
        part = re.sub(r"\[\d*\]$", "", part)
        if node.get("type") == "array" or "items" in node:
            node = node.get("items", {})
        props = node.get("properties", {})
        if part not in props:
            return bool(node.get("additionalProperties")) and not props
        node = props[part]
    return True


_KEY = re.compile(r"^(?:%s)(?:\[\d*\])?(?:\.[A-Za-z_]\w*(?:\[\d*\])?)+$" % "|".join(INLINE_SECTIONS))
_FILE_NAME = re.compile(r"\.(py|md|ya?ml|json|txt|proto|cpp|h|sh|tpl|io)$")


def test_every_module_name_and_config_key_mentioned_resolves():
    bad = []
    for doc in doc_files():
        for n, line in _lines(doc):
            for span in _code_spans(line):
                for token in re.split(r"[\s,()=/:]+", span):
                    token = token.rstrip(".")
                    if _KEY.match(token) and not _FILE_NAME.search(token):
                        module = resolve_module_name(token) if token.startswith("router.") else None
                        if not (module or resolve_config_key(token) or resolve_helm_key(token)):
                            bad.append(f"{_where(doc, n)}: {token} (no such config key or Helm value)")
            for m in _MODULE.finditer(re.sub(r"https?://\S+", " ", line)):
                name = m.group(1)
                if _FILE_NAME.search(name):
                    continue  # a file name (benchmarks.md), checked as a path
                if name.split(".")[0] == "router" and _KEY.match(name):
                    continue  # a config key (router.port), checked above when in code
                if resolve_module_name(name) is not True:
                    bad.append(f"{_where(doc, n)}: {name} (no such module, or not defined in it)")
    assert not bad, "names in the docs that the code does not have:\n  " + "\n  ".join(bad)


# -------------------------------------------------------------------------------- CLI and make
def _subcommands() -> dict[str, set[str]]:
    from cluster.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}
    out[""] = {s for a in parser._actions for s in a.option_strings}
    # `duet bench` and `duet profile` own their parsers (cluster/cli.py hands them the arguments)
    from cluster.bench import profiler, serving

    for name, own in (("bench", serving.build_parser()), ("profile", profiler.build_parser())):
        out[name] = {s for a in own._actions for s in a.option_strings}
    return out


_DUET_CMD = re.compile(r"\bduet\s+(serve|router|generate|status|drain|bench|profile|prepare-model)\b([^`|;#\n]*)")


def test_every_cli_flag_mentioned_exists():
    commands = _subcommands()
    bad = []
    for doc in doc_files():
        text = doc.read_text(encoding="utf-8")
        for n, line in enumerate(text.splitlines(), start=1):
            for m in _DUET_CMD.finditer(line):
                for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                    if flag not in commands[m.group(1)]:
                        bad.append(f"{_where(doc, n)}: duet {m.group(1)} {flag}")
    assert not bad, "flags the CLI does not have:\n  " + "\n  ".join(bad)


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE))


def test_every_make_target_mentioned_exists():
    targets = _make_targets()
    bad = [f"{_where(doc, n)}: make {t}" for doc in doc_files() for n, line in _lines(doc)
           for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", line) if t not in targets]
    assert not bad, "make targets that the Makefile does not have:\n  " + "\n  ".join(bad)


def test_every_environment_variable_mentioned_is_read_somewhere():
    sources = "\n".join(p.read_text(encoding="utf-8", errors="replace") for pkg in (*PACKAGES, "tests")
                        for p in (ROOT / pkg).rglob("*.py"))
    sources += (ROOT / "Makefile").read_text() + "".join(
        p.read_text() for p in (CHART / "templates").iterdir()) + "".join(
        p.read_text() for p in (ROOT / "deploy").glob("Dockerfile*"))
    bad = sorted({f"{_where(doc, n)}: {var}" for doc in doc_files() for n, line in _lines(doc)
                  for var in re.findall(r"\b(DUET_[A-Z0-9_]*[A-Z0-9])\b", line) if var not in sources})
    assert not bad, "environment variables nothing reads:\n  " + "\n  ".join(bad)


# ------------------------------------------------------------------------------ config blocks
def yaml_blocks() -> list[tuple[Path, int, str]]:
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = doc.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)```ya?ml\s*$", lines[i])
            if m:
                indent, start = len(m.group(1)), i + 1
                i += 1
                while not lines[i].strip().startswith("```"):
                    i += 1
                out.append((doc, start, "\n".join(line[indent:] for line in lines[start:i])))
            i += 1
    return out


COLOCATED_PROFILE = {
    "format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "colocated",
    "slo": {"ttft_p90_s": 1.0, "tpot_p90_s": 0.1},
    "capacity": {"requests_per_s": 2.0, "mean_prompt_tokens": 40.0, "mean_output_tokens": 40.0},
}


def _profile_paths(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "profile" and isinstance(v, str)] + \
            [p for v in node.values() for p in _profile_paths(v)]
    if isinstance(node, list):
        return [p for v in node for p in _profile_paths(v)]
    return []


@pytest.mark.parametrize("doc,line,text", yaml_blocks(),
                         ids=[f"{doc.relative_to(ROOT)}:{line}" for doc, line, _ in yaml_blocks()])
def test_every_yaml_block_is_a_valid_config(doc: Path, line: int, text: str, tmp_path: Path, monkeypatch):
    from cluster.config.duet import load_config

    data = yaml.safe_load(text)
    if text.lstrip().startswith("# Helm values"):
        import jsonschema

        jsonschema.validate(_defaults_merged(data), _helm_schema())
        return
    assert isinstance(data, dict) and set(data) <= set(CONFIG_SECTIONS), \
        f"{_where(doc, line)}: a yaml block is a Duet config (sections {CONFIG_SECTIONS}) or starts with '# Helm values'"
    monkeypatch.chdir(tmp_path)
    for rel in _profile_paths(data):  # what `duet profile --out rel` writes
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(COLOCATED_PROFILE))
    (tmp_path / "duet.yaml").write_text(text)
    load_config(tmp_path / "duet.yaml", env={})


def _defaults_merged(data: dict) -> dict:
    """values.yaml overlaid with a values fragment (Helm's merge: maps merge, the rest replaces)."""
    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
        return over
    return merge(yaml.safe_load((CHART / "values.yaml").read_text()), data)


# ----------------------------------------------------------------------------- measured figures
_FIGURE = re.compile(r"\b\d[\d.,]*\s*(?:tok/s|tokens/s|GB/s|ms/token|ms per token|x faster|% faster)")


def test_measured_figures_live_only_in_benchmarks_readme():
    """Throughput and speed-up figures go to benchmarks/README.md, dated; the docs link there. (The
    CLI reference is the commands' own --help, whose targets such as "< 0.2 ms/token" are not figures.)"""
    pages = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p != ROOT / "docs" / "reference" / "cli.md"]
    bad = [f"{_where(doc, n)}: {m.group(0)}" for doc in [ROOT / "README.md", *pages]
           for n, line in _lines(doc) for m in _FIGURE.finditer(line)]
    assert not bad, "measured figures outside benchmarks/README.md (link to it instead):\n  " + "\n  ".join(bad)
