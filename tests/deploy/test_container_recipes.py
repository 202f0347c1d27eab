"""The container recipes (deploy/Dockerfile, deploy/Dockerfile.cuda) against the repository they
build from. No Docker engine runs here, so the images are not built; what can drift is checked:
every COPY source exists, every pinned pip install matches pyproject.toml / the Makefile, every
`python -m` module and extra exists, the image's user, cache dir and commands are the ones the
Helm chart relies on."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [ROOT / "deploy" / "Dockerfile", ROOT / "deploy" / "Dockerfile.cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHART_VALUES = yaml.safe_load((ROOT / "deploy" / "helm" / "duet" / "values.yaml").read_text())


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                            if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def _pins(requirements: list[str]) -> dict[str, str]:
    return dict(re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", r).groups() for r in requirements if "==" in r)


@pytest.fixture(params=RECIPES, ids=[p.name for p in RECIPES])
def recipe(request) -> list[tuple[str, str]]:
    return _instructions(request.param)


def test_every_copy_source_exists_and_is_not_ignored(recipe):
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copies = [args.split() for op, args in recipe if op == "COPY"]
    assert copies
    for *sources, _dest in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert source.rstrip("/") not in ignored, f"COPY {source}: excluded by .dockerignore"
    copied = {s.rstrip("/") for *sources, _ in copies for s in sources}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages pyproject.toml installs but the image does not copy: {packages - copied}"


def test_pip_installs_match_the_pins_and_extras(recipe):
    runs = " && ".join(args for op, args in recipe if op == "RUN")
    project_pins = _pins(PYPROJECT["project"]["dependencies"])
    # literal pins only (the qwen-coder parts are generated with $(foreach ...) and not in the image)
    makefile_pins = _pins(re.findall(r"(?<![\w$(-])[A-Za-z][\w.-]*==[\w.]+", (ROOT / "Makefile").read_text()))
    installed = re.findall(r"pip install ([^&]+)", runs)
    assert installed
    for command in installed:
        for word in shlex.split(command):
            if "==" in word:
                name, version = word.split("==")
                expected = project_pins.get(name) or makefile_pins.get(name)
                assert expected == version, f"{word}: pyproject.toml / Makefile pin {name}=={expected}"
            extras = re.fullmatch(r"\.\[([\w,]+)\]", word)
            if extras:
                for extra in extras.group(1).split(","):
                    assert extra in PYPROJECT["project"]["optional-dependencies"], f"no extra {extra!r} in pyproject"
    for module in re.findall(r"python -m ([\w.]+)", runs):
        path = ROOT / module.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), f"python -m {module}: no such module"


def test_image_matches_what_the_chart_expects(recipe):
    env = " ".join(args for op, args in recipe if op == "ENV")
    assert f"DUET_CACHE_DIR={CHART_VALUES['cacheDir']}" in env
    [user] = [args for op, args in recipe if op == "USER"]
    uid = CHART_VALUES["podSecurityContext"]["runAsUser"]
    assert user == f"{uid}:{CHART_VALUES['podSecurityContext']['runAsGroup']}" and uid != 0
    assert "duet" in PYPROJECT["project"]["scripts"]  # the chart's containers run `duet ...` and `ray ...`
    assert "ray" in _pins(PYPROJECT["project"]["dependencies"])
    assert CHART_VALUES["rayVersion"] == _pins(PYPROJECT["project"]["dependencies"])["ray"]
    runs = " ".join(args for op, args in recipe if op == "RUN")
    assert "k8s" in runs  # the Kubernetes actuator's client is in the image


def test_the_commands_the_chart_runs_exist():
    parser = build_parser()
    for argv in (["serve", "--no-router"], ["router", "--membership", "h:1", "--metrics-port", "9090"]):
        args = parser.parse_args(argv)
        assert args.command == argv[0]
