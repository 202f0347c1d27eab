"""Start, health-check and always stop one server process tree; free ports; CPU use of a tree.

``ServerProcess`` starts a command in a session of its own (so its whole process group can be
signalled), logs its output to a file, polls ``http://127.0.0.1:<port><health_path>`` until it
answers 200, and on ``stop()`` (also from ``__exit__``, so Ctrl-C and errors stop it too) sends
SIGTERM to its process group, waits, then SIGKILLs what is left: the group and every descendant it
saw (Ray starts some processes in sessions of their own). Only processes this object started, or
their descendants, are ever signalled.

Example::

    with ServerProcess(argv, env, log_path, port, "/health") as proc:
        proc.wait_healthy(timeout_s=300)
        ...                                  # measure
    # stopped here, whatever happened
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

CLK_TCK = os.sysconf("SC_CLK_TCK")


class ServerFailed(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's last lines."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before children."""
    seen: list[int] = []
    todo = children_of(pid)
    while todo:
        p = todo.pop(0)
        if p not in seen:
            seen.append(p)
            todo += children_of(p)
    return seen


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children (utime + stime + cutime + cstime); 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / CLK_TCK  # fields 14-17 of proc(5), after "pid (comm)"


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s whole live tree (each process with its reaped children)."""
    return sum(proc_cpu_s(p) for p in [pid, *descendants(pid)])


def machine_busy_s() -> float:
    """CPU seconds every core has been busy since boot (/proc/stat, steal included)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, TimeoutError):
        return 0, b""


class ServerProcess:
    """One server's process tree: started on ``__enter__``/``start()``, always stopped by ``stop()``."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int,
                 health_path: str, cwd: Path | None = None) -> None:
        self.argv, self.env, self.log_path, self.port = argv, env, log_path, port
        self.health_path, self.cwd = health_path, cwd
        self.proc: subprocess.Popen | None = None
        self._seen: dict[int, int] = {}  # descendant pid -> its start time (to kill those outside the group)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        logger.info("starting: %s (log %s)", " ".join(self.argv), self.log_path)
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return self

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None else self.start()  # started already: only the stop is owed

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def note_tree(self) -> list[int]:
        """Remember (and return) the tree's live pids, so stop() can reach those that left the group."""
        assert self.proc is not None
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in pids[1:]:
            if pid not in self._seen and (t := start_time(pid)) is not None:
                self._seen[pid] = t
        return pids

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Seconds until GET health_path answered 200; ServerFailed if it exited or timed out."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            self.note_tree()
            if self.proc.poll() is not None:
                raise ServerFailed(f"exited with {self.proc.returncode} before it was healthy; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            status, _ = http_get(self.url + self.health_path, timeout_s=5.0)
            if status == 200:
                return time.monotonic() - t0
            time.sleep(poll_s)
        raise ServerFailed(f"not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the process group, wait up to grace_s, then SIGKILL the group and every
        descendant seen; idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.note_tree()
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s after SIGTERM: SIGKILL", self.log_path.name, grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        for pid, started in self._seen.items():
            if start_time(pid) == started:  # the same process, not a re-used pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None
        self._seen.clear()


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of proc(5)); None if gone or a zombie.
    With the pid it names one process for good: a pid re-used later has a later start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])
