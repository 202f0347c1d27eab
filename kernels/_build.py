"""Builds and loads the C++ CPU kernels (one torch extension, `duet_cpu_kernels`), once per process.

The sources are `kernels/csrc/*.cpp`; torch's JIT builder (`torch.utils.cpp_extension.load`, which
needs a C++ compiler and `ninja`) compiles them into a build directory under `$DUET_CACHE_DIR/kernels`
(default `~/.cache/duet/kernels`), named by a digest of what the binary depends on (`build_dir()`):
the first time, then again only when a source, a flag, torch or the checkout's location changes;
later runs load the binary from the cache. Checkouts that share a cache (branches, worktrees) thus
each keep their own build instead of rebuilding over one another (torch's loader keeps one build
per directory and rebuilds whenever its inputs differ, the include path included). The binary is built without `-march`; each kernel picks
AVX-512, AVX2+FMA or scalar code at run time from what the CPU reports, so a cache built on one x86
machine runs on another.

Switches:
  - `set_cpu_kernels_enabled(False)`: every wrapper uses its torch reference. Deliberate, so not
    counted as a fallback. A worker calls it when its `EngineConfig.cpu_kernels` is False (the
    deployment config's `pools[].engine.cpu_kernels`, which `DUET_DISABLE_CPU_KERNELS=1` sets at the
    CLI edge); this module reads no switch from the environment.
  - If the build or load fails, one WARNING names the error, `cpu_kernels_available()` is False and
    each wrapper call that had to use the reference instead counts in `fallback_counts()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from collections.abc import Iterator
from types import ModuleType

logger = logging.getLogger(__name__)

EXTENSION_NAME = "duet_cpu_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
# -ffp-contract=off: FMAs only where a kernel writes one (rotary must match torch bit for bit).
# -Wno-(maybe-)uninitialized: GCC 12's own AVX-512 headers trip them (_mm512_undefined_ps).
# Tuples: torch's loader appends to the lists it is given, and build_dir() hashes these.
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-uninitialized", "-Wno-maybe-uninitialized")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_ext: ModuleType | None = None
_error: str | None = None  # why the extension is unavailable, once a load was tried and failed
_enabled = True  # set_cpu_kernels_enabled
_fallbacks: Counter[str] = Counter()
_warned: set[str] = set()


def cache_dir() -> Path:
    """`$DUET_CACHE_DIR/kernels`, else `~/.cache/duet/kernels` (created)."""
    root = os.environ.get("DUET_CACHE_DIR")
    path = (Path(root) if root else Path.home() / ".cache" / "duet") / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_dir() -> Path:
    """``cache_dir()/duet_cpu_kernels-<digest>`` (created): the digest covers every source and header
    (name and bytes), the compiler and linker flags, the sources' location and the torch and
    Python versions, i.e. everything torch's JIT loader would rebuild for."""
    import torch

    digest = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr((CFLAGS, LDFLAGS, str(CSRC), torch.__version__, sys.version_info[:2])).encode())
    path = cache_dir() / f"{EXTENSION_NAME}-{digest.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def _headers_digest() -> str:
    # torch re-versions the extension when the sources or flags change, not when a header does; a
    # define carrying the headers' hash makes a header edit a flag change.
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*.h")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _ensure_ninja_on_path() -> None:
    # torch looks for `ninja` on PATH only. A venv run without activation has the pip-installed ninja
    # (venv/bin) off PATH, so put the interpreter's bin dir (and the ninja package's) in front.
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])


TORCH_BATON = "lock"  # the file torch.utils.cpp_extension's FileBaton creates in the build directory


@contextlib.contextmanager
def _exclusive_build_dir(path: Path) -> Iterator[None]:
    """Hold an OS lock (``fcntl.flock``) on the build directory for a whole load.

    torch's JIT loader takes a baton *file* on every load, even when nothing needs building, and a
    process killed while holding it (a worker actor killed while it starts, say) leaves the file
    behind: every later load on the machine then waits on it forever. The OS releases a flock
    when its holder dies, so while we hold ours no other Duet process is loading here and a baton
    file left in the directory is stale: it is removed (with a warning)."""
    with open(path / ".duet-build.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            baton = path / TORCH_BATON
            if baton.exists():
                logger.warning("removing the stale build lock %s (left by a process killed while it loaded the "
                               "kernels)", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def load(verbose: bool = False) -> ModuleType | None:
    """Build (if needed) and import the extension; None, after one WARNING, if that fails."""
    global _ext, _error
    if _ext is not None or _error is not None:
        return _ext
    with _lock:
        if _ext is not None or _error is not None:
            return _ext
        start = time.perf_counter()
        try:
            from torch.utils import cpp_extension

            _ensure_ninja_on_path()
            directory = build_dir()
            with _exclusive_build_dir(directory):
                _ext = cpp_extension.load(
                    name=EXTENSION_NAME,
                    sources=[str(p) for p in sources()],
                    extra_cflags=[*CFLAGS, f"-DDUET_HEADERS_DIGEST={_headers_digest()}"],
                    extra_ldflags=list(LDFLAGS),
                    extra_include_paths=[str(CSRC)],
                    build_directory=str(directory),
                    verbose=verbose,
                )
        except Exception as exc:  # noqa: BLE001 - compiler missing, build error, load error: all mean "use the refs"
            _error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "Duet CPU kernels are unavailable, every kernel op falls back to its (slower) torch "
                "reference: %s",
                _error[-2000:],
            )
            return None
        logger.info(
            "Duet CPU kernels loaded in %.1f s (isa %s) from %s", time.perf_counter() - start, _ext.active_isa(), build_dir()
        )
        return _ext


def ext() -> ModuleType | None:
    """The extension if the wrappers should use it (enabled and loaded), else None. Hot path."""
    if _enabled:
        return _ext if _ext is not None else load()
    return None


def cpu_kernels_available() -> bool:
    """True if the C++ kernels are built and loaded (building them now if needed), enabled or not."""
    return load() is not None


def cpu_kernels_enabled() -> bool:
    return _enabled


def set_cpu_kernels_enabled(enabled: bool) -> bool:
    """Turn the C++ kernels on or off for this process (tests, benchmarks); returns the old value."""
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    return old


def unavailable_reason() -> str | None:
    return _error


def note_fallback(op: str, reason: str) -> None:
    """Record that `op` ran its torch reference where a C++ kernel was wanted (warns once per reason)."""
    key = f"{op}:{reason}"
    _fallbacks[key] += 1
    if key not in _warned:
        _warned.add(key)
        logger.warning("kernels.%s: using the torch reference (%s); counted in kernels.fallback_counts()", op, reason)


def note_ref_path(op: str) -> None:
    """The wrapper used the reference on a CPU fp32 input: a fallback unless the kernels are disabled."""
    if _enabled:
        note_fallback(op, "cpu kernels unavailable")


def no_kernel_reason(x) -> str:
    """Why a wrapper has no kernel for tensor x: CUDA without triton, or an unsupported device/dtype."""
    if x.is_cuda:
        return "triton unavailable"
    return f"no kernel for {x.device.type}/{x.dtype}"


def fallback_counts() -> dict[str, int]:
    """Fallbacks so far, keyed 'op:reason'."""
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    _fallbacks.clear()
