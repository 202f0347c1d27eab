"""The code paths of the CPU kernels that use AVX-512 dot-product extensions, for tests that run each.

The bf16 GEMV uses AVX512-BF16 (vdpbf16ps) and the int8 / q4 kernels AVX512-VNNI (vpdpbusd) exactly
where the CPU reports them; otherwise an AVX-512 CPU takes a plain AVX-512 (bf16) or AVX2 (quantized)
fallback, and older CPUs the AVX2 or scalar code. "avx512" is the native path on this CPU,
"avx512-nodots" the fallback an AVX-512 CPU without those extensions takes (forced with the
extension's ``set_dot_extensions(False)``), so a machine with AMX tests what a CI machine without
AVX512-BF16 / VNNI runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

ISAS = ["avx512", "avx2", "scalar"]
DOT_PATHS = ["avx512", "avx512-nodots", "avx2", "scalar"]


@contextmanager
def on_path(ext: ModuleType, path: str) -> Iterator[None]:
    """Run the kernels on one of DOT_PATHS (the CPU must have its ISA), restoring the previous path."""
    old_isa, old_dots = ext.active_isa(), ext.dot_extensions()
    isa = path.removesuffix("-nodots")
    assert ext.set_isa(isa) == isa
    ext.set_dot_extensions(not path.endswith("-nodots"))
    try:
        yield
    finally:
        ext.set_isa(old_isa)
        ext.set_dot_extensions(old_dots)


def available_paths(ext: ModuleType) -> list[str]:
    """The DOT_PATHS this CPU can run (its best ISA and every lower one)."""
    best = ISAS.index(ext.best_isa())
    return [p for p in DOT_PATHS if ISAS.index(p.removesuffix("-nodots")) >= best]



def assert_tiles_change_no_bit(linear: Callable[..., torch.Tensor], x: torch.Tensor, bias: torch.Tensor,
                               tiles: torch.Tensor | None, tokens: list[int]) -> None:
    """``linear(x, bias, tiles)`` (an int8 / q4 kernel call) gives the same bits with the weights'
    tiles as without, for the first T rows of x for every T in ``tokens``, with and without bias, on
    one thread and on the session's threads (the row split differs)."""
    threads = torch.get_num_threads()
    try:
        for nt in sorted({1, threads}):
            torch.set_num_threads(nt)
            for T in tokens:
                for b in (None, bias):
                    assert torch.equal(linear(x[:T], b, tiles), linear(x[:T], b, None)), (T, nt, b is None)
    finally:
        torch.set_num_threads(threads)
