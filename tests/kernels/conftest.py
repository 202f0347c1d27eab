"""Fixtures for kernel tests: the built extension and a parametrisation over the ISA paths.

Every kernel is checked against its torch `*_ref` on each instruction set this CPU can run (the
kernels select AVX-512, AVX2+FMA or scalar code at run time; `set_isa` lowers the choice), so the
paths CI's CPU might take are all exercised here.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from kernels import _build
from testkit.kernel_paths import DOT_PATHS, ISAS, available_paths, on_path



@pytest.fixture(scope="session")
def ext() -> ModuleType:
    """The C++ extension (built on first use, ~1 min once per machine, then cached)."""
    mod = _build.load()
    assert mod is not None, f"CPU kernels failed to build: {_build.unavailable_reason()}"
    return mod


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, ext: ModuleType) -> Iterator[str]:
    """Run the test with the kernels forced onto one ISA path; skipped if the CPU lacks it."""
    best = ext.best_isa()
    if ISAS.index(request.param) < ISAS.index(best):
        pytest.skip(f"this CPU has no {request.param} (best: {best})")
    old = ext.active_isa()
    assert ext.set_isa(request.param) == request.param
    try:
        yield request.param
    finally:
        ext.set_isa(old)


@pytest.fixture(params=DOT_PATHS)
def dot_path(request: pytest.FixtureRequest, ext: ModuleType) -> Iterator[str]:
    """Like ``isa``, over DOT_PATHS: the native AVX512-BF16 / VNNI code and its fallbacks."""
    if request.param not in available_paths(ext):
        pytest.skip(f"this CPU has no {request.param.removesuffix('-nodots')} (best: {ext.best_isa()})")
    with on_path(ext, request.param):
        yield request.param
