"""The client as a distribution of its own (clients/python/pyproject.toml, `duet-client`): its wheel
holds exactly the client's modules, installs into a fresh venv with nothing but its declared
dependencies (grpcio, grpcio-health-checking, protobuf: no torch, no Ray, no numpy), and works
there: a request with a structured-output spec is built and streamed from a small duet.v1 server
written with the wheel's own stubs, a bad spec is refused before any call, and a closed port fails
with DuetError UNAVAILABLE.

The dependencies come from the package index pip is configured with (pinned to the server's own
versions from pyproject.toml by a constraints file), so the first run downloads ~10 MB; later ones
hit pip's cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python"
SOURCES = ("router", "protos", "workers")  # what package-dir = "../.." reaches into
WHEEL_FILES = {
    "protos/__init__.py", "protos/duet/__init__.py", "protos/duet/v1/__init__.py", "protos/duet/v1/duet.proto",
    "protos/duet/v1/duet_pb2.py", "protos/duet/v1/duet_pb2.pyi", "protos/duet/v1/duet_pb2_grpc.py",
    "router/__init__.py", "router/client.py",
    "workers/__init__.py", "workers/errors.py", "workers/structured/__init__.py", "workers/structured/spec.py",
    "workers/structured/convert.py",
}

USE_IT = r'''
import asyncio, json, sys
from concurrent import futures

import grpc
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.client import DuetClient, DuetError, StructuredOutput, build_request, generate_text
from workers.errors import InvalidRequestError


class Echo(duet_pb2_grpc.DuetServicer):
    """Streams the prompt back word by word, then what the request's structured spec asked for."""

    def Generate(self, request, context):
        words = request.prompt.split()
        for i, w in enumerate(words):
            yield duet_pb2.GenerateResponse(request_id=request.request_id, text=w + " ", token_ids=[i])
        kind = request.sampling.structured.WhichOneof("kind")
        yield duet_pb2.GenerateResponse(request_id=request.request_id, text=f"[{kind}:{','.join(request.sampling.structured.choice.choices)}]",
                                        finish_reason=duet_pb2.FINISH_REASON_STOP,
                                        usage=duet_pb2.Usage(prompt_tokens=len(words), completion_tokens=len(words) + 1))


spec = StructuredOutput("choice", choices=("yes", "no"))
req = build_request("Is it on?", structured=spec, max_tokens=4, temperature=0)
assert req.sampling.structured.choice.choices == ["yes", "no"] and req.sampling.max_tokens == 4
try:
    StructuredOutput("regex", "")
    raise SystemExit("an empty regex was accepted")
except InvalidRequestError as e:
    refused = str(e)

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
duet_pb2_grpc.add_DuetServicer_to_server(Echo(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
text = generate_text("is it on", target=f"127.0.0.1:{port}", structured=spec, timeout=10)
server.stop(None)


async def closed():
    async with DuetClient(f"127.0.0.1:{port}", retries=0) as c:
        try:
            await c.complete("hi", timeout=5)
        except DuetError as e:
            return e.code.name
    return "no error"

heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "numpy", "transformers", "cluster", "kernels"))
project = sorted(m for m in sys.modules if m.split(".")[0] in ("router", "workers", "protos"))
print(json.dumps(dict(text=text, refused=refused, closed=asyncio.run(closed()), heavy=heavy, project=project)))
'''


def _pins() -> list[str]:
    """The server's exact pins of the client's dependencies (pyproject.toml), as constraints."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {"grpcio", "grpcio-health-checking", "protobuf"}
    return [d for d in deps if re.split(r"[=<>!~ ]", d, maxsplit=1)[0] in names]


def _run(cmd: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``cmd`` without this test's PYTHONPATH: pip and the venv see only what is installed there."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """duet-client's wheel, built from a copy of the sources (setuptools writes its build and egg-info
    folders next to them, so the checkout stays clean) with this venv's setuptools."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(CLIENT, src / "clients" / "python", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
          str(src / "clients" / "python")], timeout=120)
    [whl] = out.glob("duet_client-*.whl")
    return whl


def test_the_wheel_holds_exactly_the_client_and_declares_only_grpc_and_protobuf(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    assert {n for n in names if ".dist-info/" not in n} == WHEEL_FILES
    assert sorted(re.split(r"[=<>!~ ]", r, maxsplit=1)[0] for r in requires) == [
        "grpcio", "grpcio-health-checking", "protobuf"]


def test_the_client_installs_and_works_in_a_venv_without_torch_or_ray(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=60)
    py = venv / "bin" / "python"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(_pins()) + "\n")
    # this venv's pip installs into the new one (--python): the new venv needs no pip of its own
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--disable-pip-version-check",
          "-c", str(constraints), str(wheel)], timeout=300)
    installed = _run([sys.executable, "-m", "pip", "--python", str(py), "list", "--format=freeze"], timeout=60).stdout
    names = sorted(line.split("==")[0].lower().replace("_", "-") for line in installed.splitlines() if "==" in line)
    # typing-extensions: grpcio's own dependency
    assert set(names) - {"typing-extensions"} == {"duet-client", "grpcio", "grpcio-health-checking", "protobuf"}, names
    r = _run([str(py), "-I", "-c", USE_IT], timeout=120, cwd=tmp_path)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["text"] == "is it on [choice:yes,no]"
    assert got["refused"].startswith("structured.regex:")
    assert got["closed"] == "UNAVAILABLE"
    assert got["heavy"] == []
    assert set(got["project"]) <= {m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                                   for m in WHEEL_FILES if m.endswith(".py")}
