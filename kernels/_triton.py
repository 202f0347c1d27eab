"""The optional Triton GPU kernels: whether they can run, and how the wrappers reach them.

Triton is an optional extra (`pip install -e '.[triton]'`, ~200 MB wheel, ~700 MB installed); the
kernels live in `kernels/triton_ops/<op>.py`, one file per op like the C++ ones in `kernels/csrc/`,
and are imported only when a wrapper first sees a CUDA tensor, so a CPU-only process never imports
triton. On CUDA tensors a wrapper runs its Triton kernel when triton is importable; otherwise it
uses its torch reference, logs one WARNING and counts `<op>:triton unavailable` in
`kernels.fallback_counts()` (no silent fallback).

Testing without a GPU: Triton's interpreter runs the same kernels on CPU tensors with numpy when
`TRITON_INTERPRET=1` is set before the kernel modules are imported (the `@triton.jit` decorator
reads it). The interpreter's bf16 arithmetic is wrong, so every kernel loads its inputs and casts
them to fp32 before computing, and casts results back to the output dtype when storing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

_available: bool | None = None


def triton_available() -> bool:
    """True if the `triton` package is importable (checked once, without importing it)."""
    global _available
    if _available is None:
        _available = importlib.util.find_spec("triton") is not None
    return _available


def interpreting() -> bool:
    """True if Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def ops(name: str) -> ModuleType:
    """The Triton kernel module `kernels.triton_ops.<name>` (imports triton on first use)."""
    return importlib.import_module(f"kernels.triton_ops.{name}")


def check_device(t, op: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter only."""
    if not t.is_cuda and not interpreting():
        raise ValueError(
            f"{op}: Triton kernels need CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 before "
            "importing kernels.triton_ops to run them on CPU in Triton's interpreter"
        )


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())
