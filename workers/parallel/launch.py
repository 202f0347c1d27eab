"""Run a function on a gang of local processes (one per rank) joined in one torch.distributed
world: the harness behind the expert-parallel tests and benchmarks. (Serving gangs are Ray actors;
see workers/engine/gang_runner.py for what each rank does.)

Worked example::

    def work(rank: int, n: int) -> int:        # module-level, so spawned processes can import it
        return get_group("ep").world_size * n

    spawn_gang(work, ParallelConfig(ep_size=2), args=(3,))   # -> [6, 6], one result per rank

Each rank sets its torch thread count (``num_threads``, default 1: W processes on a small machine
must not oversubscribe the cores), calls ``init_parallel_groups``, runs ``fn(rank, *args)`` and
sends back the result (keep it picklable: lists, numpy arrays). A rank that raises fails the whole
call with its traceback; every process is reaped, even on timeout.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
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
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_entry, args=(r, fn, config, init, args, out, num_threads, collective_timeout, devices[r],
                                         backend),
                    daemon=True)
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
