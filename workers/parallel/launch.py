"""Run a function on a gang of local processes (one per rank) joined in one torch.distributed
world: the harness behind the expert-parallel tests and benchmarks. (Serving gangs are Ray actors;
see workers/engine/gang_runner.py for what each rank does.)

Worked example::

    def work(rank: int, n: int) -> int:        # module-level, so rank processes can import it
        return get_group("ep").world_size * n

    spawn_gang(work, ParallelConfig(ep_size=2), args=(3,))   # -> [6, 6], one result per rank

Each rank sets its torch thread count (``num_threads``, default 1: W processes on a small machine
must not oversubscribe the cores), calls ``init_parallel_groups``, runs ``fn(rank, *args)`` and
sends back the result (keep it picklable: lists, numpy arrays). A rank that raises fails the whole
call with its traceback; every process is reaped, even on timeout.

Ranks are forked from a ``multiprocessing`` fork server (one per calling process, started by the
first call) that has imported torch and transformers once: a spawned rank would import them again
(seconds a rank, often more than a small gang's own work), a forked one starts at once. The server
imports nothing else and runs nothing, so a rank starts as clean as a spawned one (one thread, no
CUDA context, none of the caller's state); it takes the caller's environment as it is at the call,
as a spawned rank would.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from workers.parallel.groups import ParallelConfig, destroy_parallel_groups, init_parallel_groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports before forking ranks (a module that is not installed is skipped).
PRELOAD = ("torch", "transformers", "workers.parallel.groups")


def process_context() -> Any:
    """The multiprocessing context ranks start from: the fork server (see the module docstring). Its
    preload list only counts before the server's first start."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def helper_process(target: Callable, args: tuple = (), daemon: bool = True) -> Any:
    """An unstarted process that runs ``target(*args)`` started as a rank is (forked from the fork
    server, in the caller's environment as of this call): for a test's or benchmark's peer process.
    Queues for it come from ``process_context()``."""
    return process_context().Process(target=_in_env, args=(dict(os.environ), target, args), daemon=daemon)


def _in_env(env: dict[str, str], target: Callable, args: tuple) -> None:
    os.environ.clear()  # the caller's environment at the call, not the fork server's from when it started
    os.environ.update(env)
    target(*args)


def _entry(rank: int, fn: Callable, config: ParallelConfig, init_method: str, args: tuple, out: Any,
           num_threads: int, collective_timeout: float, device: str, backend: str | None) -> None:
    import torch

    torch.set_num_threads(num_threads)
    try:
        init_parallel_groups(config, rank, init_method, timeout=timedelta(seconds=collective_timeout), device=device,
                             backend=backend)
        out.put((rank, True, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        out.put((rank, False, traceback.format_exc()))
    finally:
        destroy_parallel_groups()


def spawn_gang(fn: Callable, config: ParallelConfig, args: tuple = (), num_threads: int = 1,
               timeout: float = 300.0, collective_timeout: float = 60.0, comm: str | None = None,
               devices: list[str] | None = None, backend: str | None = None) -> list[Any]:
    """fn(rank, *args) on every rank of a fresh local gang; returns the results in rank order.
    ``comm`` overrides ``config.comm`` ('auto', 'shm' or 'gloo'). ``devices``: each rank's device
    (default cpu), which picks the backend (workers/parallel/groups.py ``gang_backend``) unless
    ``backend`` names one."""
    devices = devices or ["cpu"] * config.world_size
    if len(devices) != config.world_size:
        raise ValueError(f"devices: {len(devices)} given for a gang of {config.world_size} ranks")
    if comm is not None:
        config = dataclasses.replace(config, comm=comm)
    out = process_context().Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        helper_process(_entry, (r, fn, config, init, args, out, num_threads, collective_timeout, devices[r], backend))
        for r in range(config.world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < len(procs):
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"gang of {len(procs)} ranks: no result within {timeout} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(len(procs))]
