"""`duet bench` from a checkout, writing into benchmarks/results/ (the dated runs in benchmarks/README.md).

The benchmark itself is cluster/bench/serving.py (what `duet bench` runs from an installed package);
this script only changes where the results go unless ``--out`` is given::

    .venv/bin/python -m benchmarks.serving_bench --quick
"""

from __future__ import annotations

import sys
from pathlib import Path

from cluster.bench.serving import main as bench_main

RESULTS = Path(__file__).resolve().parent / "results" / "serving_bench.json"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    has_out = any(a == "--out" or a.startswith("--out=") for a in argv)
    return bench_main(argv if has_out else [*argv, "--out", str(RESULTS)])


if __name__ == "__main__":
    sys.exit(main())
