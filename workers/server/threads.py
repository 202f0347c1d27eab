"""A worker process's threads: how many compute threads, how idle OpenMP threads wait, what priority,
and how its memory is paged.

Why it matters (benchmarks/README.md, "threads on a busy node"): torch runs its CPU ops on an
OpenMP thread pool with a barrier after every parallel region (hundreds per decode step). By
default libgomp's idle threads spin ~300k iterations before sleeping. When another process takes
one of the worker's cores, the thread descheduled there reaches each barrier late while the others
spin on their cores, so every region costs up to a scheduler time slice: a decode step that takes
tens of milliseconds takes seconds. ``OMP_WAIT_POLICY=PASSIVE`` makes idle threads sleep at once,
which gives the core back to the late thread. The policy is read once, when the OpenMP runtime
loads (with torch), so it must be in the process's environment at start: ``process_env`` says what
to put there (duet serve passes it as the actor's Ray ``runtime_env``), ``apply`` checks it inside
the process and logs a warning when it is not what the config asks.

Priority: Ray starts worker processes at niceness 15 (``RAY_worker_niceness``), so the router and
Ray's own daemons on the node preempt the engine whenever they run. Duet's default is 0
(``EngineConfig.niceness``): the engine is what the node is for. Linux keeps a nice value per
thread, so ``apply`` sets every thread of the process (threads started later inherit it);
lowering it needs CAP_SYS_NICE, which is why the start-up environment (Ray applies
RAY_worker_niceness itself) is the main mechanism.

Memory (``EngineConfig.memory_tuning``, on by default): glibc's malloc reads ``GLIBC_TUNABLES`` once,
at start, too. ``hugetlb=1`` makes it ask for transparent huge pages (MADV_HUGEPAGE) on what it maps,
so the weights and activations the linear layers stream miss the TLB less where THP is in 'madvise'
mode (the common default); the mmap and trim thresholds keep a step's large temporaries (the
logits of a 64-row batch are 12 MiB) in a heap that is reused, where glibc would otherwise unmap
them when freed and fault 3,000 fresh pages in again the next step. The KV cache, mapped by the
engine itself, asks for huge pages on its own map (workers/engine/model_runner.py ``zeroed``).

Worked example::

    env = process_env(EngineConfig())    # {"OMP_WAIT_POLICY": "PASSIVE", "RAY_worker_niceness": "0",
                                         #  "GLIBC_TUNABLES": MALLOC_TUNABLES}
    actor = WorkerActor.options(runtime_env={"env_vars": env}).remote(config, "w0")
    # inside the actor: apply(config, num_threads=2) -> ThreadSettings(2, "PASSIVE", 0)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from workers.config import EngineConfig

logger = logging.getLogger(__name__)

RAY_NICENESS_ENV = "RAY_worker_niceness"  # read by Ray's core worker when the process starts
# glibc malloc, read at process start (memory_tuning): transparent huge pages on its maps; blocks up
# to 64 MiB from the reusable heap rather than a map of their own; return free heap to the system
# only past 512 MiB at its top
MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=67108864:"
                   "glibc.malloc.trim_threshold=536870912")


@dataclass(frozen=True)
class ThreadSettings:
    """What a worker process runs with (``info()`` of the actors reports it)."""

    num_threads: int
    omp_wait_policy: str | None  # the OMP_WAIT_POLICY the process started with (None: unset)
    niceness: int  # of the calling thread after ``apply`` (every thread of the process has it)
    glibc_tunables: str | None = None  # the GLIBC_TUNABLES the process started with (None: unset)


def process_env(config: EngineConfig) -> dict[str, str]:
    """Environment variables a worker process must start with for ``config``'s thread settings."""
    env = {}
    if config.omp_wait_policy != "runtime":
        env["OMP_WAIT_POLICY"] = config.omp_wait_policy.upper()
    if config.niceness is not None:
        env[RAY_NICENESS_ENV] = str(config.niceness)
    if config.memory_tuning:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    return env


def apply(config: EngineConfig, num_threads: int, environ: Mapping[str, str] | None = None) -> ThreadSettings:
    """Inside the worker process: set torch's thread count and the niceness of every thread, and
    check that the OpenMP wait policy the process started with is the config's (a warning names the
    difference: it cannot change after start)."""
    environ = os.environ if environ is None else environ
    torch.set_num_threads(num_threads)
    want = process_env(config).get("OMP_WAIT_POLICY")
    have = environ.get("OMP_WAIT_POLICY")
    if want is not None and (have or "").upper() != want:
        logger.warning("OMP_WAIT_POLICY is %r in this worker process, the config asks for %r (omp_wait_policy); "
                       "it is read once at start, so this process keeps the former: start the worker with "
                       "workers.server.threads.process_env(config) in its environment (duet serve does)", have, want)
    if config.memory_tuning and MALLOC_TUNABLES not in environ.get("GLIBC_TUNABLES", ""):
        logger.warning("GLIBC_TUNABLES is %r in this worker process; memory_tuning asks for %r, which glibc reads "
                       "once at start: this process keeps the system's malloc settings (start it with "
                       "workers.server.threads.process_env(config) in its environment, as duet serve does)",
                       environ.get("GLIBC_TUNABLES"), MALLOC_TUNABLES)
    # every thread, not only this one: Ray applies RAY_worker_niceness to the thread that reads it, after
    # some of its own threads exist, so the calling thread can be right while others are not
    if config.niceness is not None and thread_niceness() != {config.niceness}:
        set_niceness(config.niceness)
    return ThreadSettings(num_threads, have, os.getpriority(os.PRIO_PROCESS, 0), environ.get("GLIBC_TUNABLES"))


def thread_niceness() -> set[int]:
    """The nice values of this process's threads (one value when ``apply`` could set them all)."""
    values = set()
    for tid in _tids():
        try:
            values.add(os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:
            continue
    return values


def _tids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: one nice value per process
        return [0]


def set_niceness(niceness: int) -> None:
    """Every thread of this process at ``niceness`` (Linux keeps one per thread). Without the right
    to lower it (CAP_SYS_NICE), a warning says so and the threads keep theirs."""
    for tid in _tids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            logger.warning("cannot set this worker's niceness to %d (now %d): lowering it needs CAP_SYS_NICE; "
                           "start the worker with %s=%d in its environment (duet serve does) or set niceness "
                           "to null", niceness, os.getpriority(os.PRIO_PROCESS, 0), RAY_NICENESS_ENV, niceness)
            return
