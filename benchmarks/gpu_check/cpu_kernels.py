"""Build (or load from the cache) the C++ CPU kernels before the sections that run models on CPU
(the CPU drafter, and every model section on a CPU-only machine), so their budgets are not spent
compiling. A machine without a C++ toolchain is reported here; the CPU code then runs the torch
references (slower, same results) with a warning."""

from __future__ import annotations

import time

CUDA_ONLY = False
BUDGET_S = 45.0


def run(ctx) -> dict:
    from kernels import _build

    t0 = time.perf_counter()
    ext = _build.load()
    secs = round(time.perf_counter() - t0, 1)
    if ext is None:
        return {"status": "skipped", "reason": f"C++ CPU kernels unavailable ({_build.unavailable_reason()}); "
                                               "CPU sections use the torch references", "seconds_to_load": secs}
    return {"checks": {"built_or_loaded": True}, "isa": ext.active_isa(), "cache": str(_build.cache_dir()),
            "summary": f"ready in {secs} s ({ext.active_isa()})"}
