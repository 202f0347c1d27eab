"""`python -m kernels.build`: build (or load from the cache) the C++ CPU kernels and say what was built.

Run by `make setup` so the first compile (the slow part) does not land in a test or a server's first request.
Exits 1 if the build fails (the library itself would fall back to the torch references with a warning).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kernels import _build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    ext = _build.load(verbose=args.verbose)
    if ext is None:
        print(f"duet CPU kernels: BUILD FAILED: {_build.unavailable_reason()}", file=sys.stderr)
        return 1
    sources = ", ".join(p.name for p in _build.sources())
    print(f"duet CPU kernels: {_build.EXTENSION_NAME} ready in {time.perf_counter() - start:.1f} s")
    print(f"  cache:   {_build.build_dir()}")
    print(f"  sources: {sources}")
    print(f"  isa:     {ext.active_isa()} (best this CPU supports: {ext.best_isa()})")
    print(
        "  ops:     rms_norm, silu_and_mul, gemv (kernels.linear), paged_decode_attention, rotary_and_cache_write, grouped_gemm, "
        "varlen_paged_attention, merge_attn_states"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
