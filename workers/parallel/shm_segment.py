"""The shared-memory segment of a same-host group: its layout, creation, host identity and the
sweep of files left by dead creators (the collectives over it are in workers/parallel/shm_comm.py).

Layout of a segment for W ranks (B = ``SLOT_BYTES``)::

    [0, 64)                    header: magic, nonce (checks a rank mapped the right file), W
    [64 (1 + r), +8)           rank r's sequence counter, one cache line each (no false sharing)
    [data_offset(W), +2 W B)   two buffers of W slots: slot (buffer b, rank r) at data_offset + (b W + r) B

A segment file is named ``duet-shm-<creator pid>-<random>`` under /dev/shm and unlinked by its
creator as soon as every rank has mapped it; a file whose creator died before that is removed by
the next ``sweep_stale`` (every creation runs one).
"""

from __future__ import annotations

import glob
import mmap
import os
import platform
import secrets

import numpy as np

SHM_DIR = "/dev/shm"
PREFIX = "duet-shm-"
SLOT_BYTES = 4 << 20  # per rank per buffer: a [8, V / 2] logits gather of a 150k vocabulary fits in one round
HEADER_LINE = 64  # one cache line per counter: no false sharing between ranks' flags
MAGIC = 0x4455455453484D31  # "DUETSHM1"


def supported() -> bool:
    """Whether this host can run the shared-memory path (x86-64 Linux: see shm_comm.py on memory order)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


def node_key() -> str:
    """Identifies the host (and its /dev/shm): hostname plus the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep_stale() -> int:
    """Unlink segments whose creator died before unlinking them; returns how many."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not alive(pid):
            try:
                os.unlink(path)
                n += 1
            except FileNotFoundError:
                pass
    return n


def segment_bytes(world: int) -> int:
    return data_offset(world) + 2 * world * SLOT_BYTES


def data_offset(world: int) -> int:
    return -(-(HEADER_LINE * (1 + world)) // 4096) * 4096


def create_segment(world: int) -> tuple[str, int]:
    """Create and size a fresh segment file (rank 0); returns (path, nonce). The caller unlinks it."""
    sweep_stale()
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    nonce = secrets.randbits(63)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(world))
        with mmap.mmap(fd, HEADER_LINE) as mm:
            mm[:24] = np.array([MAGIC, nonce, world], dtype=np.int64).tobytes()
    finally:
        os.close(fd)
    return path, nonce
