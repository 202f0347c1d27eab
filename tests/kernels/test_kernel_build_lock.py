"""A process killed while it loads the C++ kernels must not wedge every later load: torch's JIT
loader leaves its baton file behind, and kernels/_build.py clears it under an OS lock that dies
with its holder. Run in subprocesses against the real kernel cache (built by `make setup`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kernels import _build

LOAD = "from kernels import _build; import sys; sys.exit(0 if _build.load() is not None else 3)"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(_build.CSRC.parent.parent), os.environ.get("PYTHONPATH", "")])}


def test_a_stale_torch_baton_does_not_block_loading():
    _build.load()  # built and cached (the normal state after make setup)
    baton = _build.build_dir() / _build.TORCH_BATON
    baton.touch()  # what a process killed inside cpp_extension.load() leaves behind
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", LOAD], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not baton.exists() and "stale build lock" in r.stderr
    assert time.monotonic() - t0 < 60


def test_a_loader_killed_while_holding_the_lock_releases_it():
    hold = ("import fcntl, sys, time; from kernels import _build\n"
            "f = open(_build.build_dir() / '.duet-build.flock', 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "(_build.build_dir() / _build.TORCH_BATON).touch(); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)  # dies holding both the flock and a baton file
        holder.wait(10)
        r = subprocess.run([sys.executable, "-c", LOAD], env=_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert not (_build.build_dir() / _build.TORCH_BATON).exists()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_build_dir_is_keyed_by_what_the_binary_depends_on(tmp_path, monkeypatch):
    """Checkouts sharing one cache keep separate builds: the same sources at the same place map to
    the same directory; other bytes, or the same bytes elsewhere (torch's loader would rebuild
    for a new include path), map to another."""
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    here = _build.build_dir()
    assert here == _build.build_dir() and here.parent == _build.cache_dir() and here.is_dir()
    copy = tmp_path / "checkout" / "csrc"
    copy.mkdir(parents=True)
    for p in [*_build.CSRC.glob("*.cpp"), *_build.CSRC.glob("*.h")]:
        (copy / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(_build, "CSRC", copy)
    elsewhere = _build.build_dir()
    assert elsewhere != here
    (copy / "rms_norm.cpp").write_bytes((copy / "rms_norm.cpp").read_bytes() + b"\n// edited\n")
    assert _build.build_dir() not in (here, elsewhere)
