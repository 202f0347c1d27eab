"""Regenerate (or check) the Python stubs of every ``.proto`` under ``protos/``.

Usage, from the repository root::

    python -m protos.generate           # rewrite the checked-in *_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m protos.generate --check   # regenerate into a temp dir, diff, exit 1 on drift

How the stubs are laid out: protoc runs with ``-I protos``, so each file's descriptor name is its
canonical path (``duet/v1/duet.proto``, mirroring the package ``duet.v1``): what server reflection
reports and what clients in other languages ``import``. protoc then emits Python imports relative
to that root (``from duet.v1 import duet_pb2``); this script rewrites them to the installed
package (``from protos.duet.v1 import duet_pb2``). That keeps one module name per stub (no
``sys.path`` entry that would load the same proto under two names and break ``isinstance``) and
no repository-specific prefix in the proto paths.

The output depends on the grpcio-tools version (pinned in pyproject.toml); ``--check`` failing
after an upgrade just means: run the generator and commit the result.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the `protos` package directory
PY_PACKAGE = "protos"  # import name of PROTO_ROOT
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_INIT_TEXT = ""  # generated packages get empty __init__.py files


class GenerateError(RuntimeError):
    """protoc failed, or its output is not what this script expects."""


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under ``root``, relative to it, in a stable order."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def expected_outputs(root: Path = PROTO_ROOT) -> list[Path]:
    """Generated files (relative to ``root``): three stubs per proto plus package __init__.py files."""
    out: set[Path] = set()
    for proto in proto_files(root):
        out.update(proto.with_name(proto.stem + suffix) for suffix in STUB_SUFFIXES)
        out.update(parent / "__init__.py" for parent in proto.parents if parent != Path("."))
    return sorted(out)


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto under ``root`` into ``out_dir``; returns the files written (relative)."""
    from grpc_tools import protoc  # a build-time tool: imported only when generating

    protos = proto_files(root)
    if not protos:
        raise GenerateError(f"no .proto files under {root}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise GenerateError(f"protoc failed (args: {' '.join(args[1:])})")
    top_packages = sorted({p.parts[0] for p in protos if len(p.parts) > 1})
    written = expected_outputs(root)
    for rel in written:
        path = out_dir / rel
        if rel.name == "__init__.py":
            if not path.exists():
                path.write_text(_INIT_TEXT)
            continue
        if not path.exists():
            raise GenerateError(f"protoc did not produce {rel}")
        path.write_text(_rewrite_imports(path.read_text(), top_packages))
    return written


def _rewrite_imports(text: str, top_packages: list[str]) -> str:
    """``from duet.v1 import x_pb2`` -> ``from protos.duet.v1 import x_pb2`` (our protos only)."""
    if not top_packages:
        return text
    names = "|".join(re.escape(p) for p in top_packages)
    text = re.sub(rf"^(\s*)from ({names})((?:\.\w+)*) import ", rf"\1from {PY_PACKAGE}.\2\3 import ", text,
                  flags=re.M)
    leftover = re.search(rf"^\s*import ({names})\b", text, flags=re.M)
    if leftover:
        raise GenerateError(f"unexpected import form in generated code: {leftover.group(0).strip()!r}")
    return text


def check(root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate into a temp dir and compare with the files under ``root``. Returns the problems
    (empty when everything is up to date); each names the file and, for content drift, shows a diff."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="duet-protos-") as tmp:
        fresh = Path(tmp)
        expected = generate(fresh, root)
        for rel in expected:
            want, have = fresh / rel, root / rel
            if not have.exists():
                problems.append(f"{rel}: missing")
            elif rel.name == "__init__.py":
                continue  # only its presence matters (it makes the folder a package)
            elif have.read_text() != want.read_text():
                diff = difflib.unified_diff(have.read_text().splitlines(), want.read_text().splitlines(),
                                            f"checked-in/{rel}", f"generated/{rel}", lineterm="", n=1)
                problems.append(f"{rel}: differs\n" + "\n".join(list(diff)[:40]))
        stale = {p.relative_to(root) for s in STUB_SUFFIXES for p in root.rglob(f"*{s}")} - set(expected)
        problems.extend(f"{rel}: stale (its .proto is gone); delete it" for rel in sorted(stale))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temp dir and exit 1 if the checked-in stubs differ")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        if problems:
            print("protos: generated stubs are out of date:", *problems, sep="\n", file=sys.stderr)
            print("fix: python -m protos.generate (then commit the stubs)", file=sys.stderr)
            return 1
        print(f"protos: {len(proto_files())} proto files, stubs up to date")
        return 0
    written = generate(PROTO_ROOT)
    print(f"protos: wrote {len(written)} files under {PROTO_ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
