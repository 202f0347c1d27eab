"""The Ray actor shell around one worker: lifecycle only, no engine logic.

Ray owns the process (placement, restarts); ``workers.server.service`` owns everything else (the engine
thread, the gRPC service, health). The actor is async, so the gRPC server runs inside the actor's
own event loop and the actor stays responsive to ``endpoint()`` / ``stop()`` while it serves.

Threads: torch's intra-op thread count is set to the CPUs Ray reserved for the actor (at least 1),
both here and on the engine thread. On a small machine this matters a lot: two processes each
running as many OpenMP threads as there are cores slow torch down by an order of magnitude
(OpenMP threads spin-wait for each other on oversubscribed cores), so threads must match the
reservation. How idle OpenMP threads wait and the process's niceness come from the engine config
(``omp_wait_policy``, ``niceness``; workers/server/threads.py): the pool starts the actor with
``process_env(config)`` in its Ray runtime_env, and ``__init__`` applies and checks them.

Worked example (from the cluster side)::

    config = EngineConfig()
    actor = WorkerActor.options(num_cpus=1, max_restarts=-1,
                                runtime_env={"env_vars": process_env(config)}).remote(config, "decode-0")
    endpoint = ray.get(actor.start.remote())       # "10.0.0.5:41231": the router dials this
    ...
    ray.get(actor.stop.remote())                    # drain, abort the rest, stop serving
    ray.kill(actor)

Standby (cluster/deploy/pools.py): ``prepare()`` loads the model and tokenizer (weights mapped from
the node's snapshot when ``shared_weights_dir`` is set), warms them up once through a throwaway
engine, and stops there: no KV cache, no engine, no endpoint. A later ``start()`` promotes it: it
builds the KV cache and engine around what is loaded and serves, in a fraction of a cold start. ``startup()`` reports both starts' phases
(workers/startup.py).

``prepare("process")`` stops earlier: a *warm worker process* (the pool's ``standby_load: process``)
has imported the worker stack, read the model's config and tokenizer and loaded the CPU kernels
(workers/build.py ``prewarm``), but holds no weights. Its ``start()`` is a whole start in this
process -- weights (mapped from the node's snapshot with ``shared_weights_dir``), KV cache, warm-up,
serving -- without the process start, the imports and the first reads a new replica pays.

After a Ray restart the actor comes back *not serving* (``__init__`` runs again, ``start`` does
not): whoever owns the pool calls ``start()`` again and learns the new endpoint (the port is chosen
afresh unless one was given) and, from GetLoad, the new incarnation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

import ray

from workers.build import Preloaded, build_engine, preload, prewarm
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.device import resolve_for_rank
from workers.models.assets.resolve import resolve_model
from workers.server.service import WorkerServer, start_worker_server
from workers.server.threads import apply as apply_threads
from workers.server.threads import thread_niceness
from workers.startup import StartupTimeline

logger = logging.getLogger(__name__)

STANDBY_LOADS = ("model", "process")  # how far prepare() brings a standby replica (module docstring)


def rank_config(config: EngineConfig, gpus: float) -> EngineConfig:
    """A rank's engine config, ready to build on: the model name resolved to a checkpoint directory
    here, at the edge (it may prepare or download it once per node; engines never do), then device and
    dtype resolved against the ``gpus`` GPUs Ray assigned (a pool reserving GPUs on a node without
    CUDA is refused, naming the key)."""
    config = dataclasses.replace(config, model=str(resolve_model(config.model)))
    return resolve_for_rank(config, gpus)


@ray.remote(num_cpus=1)
class WorkerActor:
    """One engine behind the internal gRPC service, in its own Ray worker process.

    host: address to bind and advertise; default the node's IP (``ray.util.get_node_ip_address()``).
    port: 0 picks a free port.
    """

    def __init__(self, engine_config: EngineConfig, worker_id: str, host: str | None = None, port: int = 0) -> None:
        self._init_at = time.monotonic()  # the end of the cluster-side "schedule" phase
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        self._threads = apply_threads(engine_config, max(1, int(cpus)))
        self._num_threads = self._threads.num_threads
        self._config = engine_config
        self._gpu_ids = [str(g) for g in ray.get_gpu_ids()]  # what Ray assigned (it sets CUDA_VISIBLE_DEVICES)
        self._worker_id = worker_id
        self._host = host or ray.util.get_node_ip_address()
        self._port = port
        self._server: WorkerServer | None = None
        self._preloaded: Preloaded | None = None
        self._tokenizer: Any = None  # a warm worker process's (prepare("process")), until start()
        self._resolved = False
        self._timelines: dict[str, StartupTimeline] = {}  # "prepare" (standby load), "start"
        self._lock: asyncio.Lock | None = None  # created on the actor's event loop

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _resolve(self, timeline: StartupTimeline) -> None:
        if not self._resolved:
            self._config = await asyncio.to_thread(rank_config, self._config, float(len(self._gpu_ids)))
            self._resolved = True
            timeline.mark("resolve")

    async def prepare(self, load: str = "model") -> None:
        """Standby: ``load`` "model" loads the model and tokenizer, no KV cache, no serving; "process"
        only prepares a warm worker process (module docstring). Idempotent; a no-op once serving."""
        if load not in STANDBY_LOADS:
            raise ValueError(f"prepare(load={load!r}): one of {', '.join(STANDBY_LOADS)}")
        async with self._guard():
            if self._preloaded is not None or self._tokenizer is not None or self._server is not None:
                return
            timeline = StartupTimeline.start(self._init_at)
            await self._resolve(timeline)
            if load == "model":
                self._preloaded = await asyncio.to_thread(self._preload, timeline)
            else:
                self._tokenizer = await asyncio.to_thread(prewarm, self._config, timeline)
            self._timelines["prepare"] = timeline
            logger.info("actor %s: standby (%s in %.2f s; %s)", self._worker_id,
                        "loaded" if load == "model" else "warm process", timeline.elapsed_s,
                        timeline.notes.get("weights", "no weights"))

    def _preload(self, timeline: StartupTimeline) -> Preloaded:
        import torch  # the worker process only (the driver imports this module too)

        torch.set_num_threads(self._num_threads)  # this thread's OpenMP pool, as on the engine thread
        pre = preload(self._config, timeline)
        pre.warm_up(self._config, timeline)
        return pre

    async def start(self) -> str:
        """Load the engine and serve (promote a standby: only the KV cache, warm-up and server are
        left); returns the endpoint ("host:port"). Idempotent."""
        async with self._guard():
            if self._server is None:
                promoted = self._preloaded is not None or self._tokenizer is not None
                timeline = StartupTimeline.start(None if promoted else self._init_at)
                await self._resolve(timeline)
                make_engine = None
                config = self._config
                if (pre := self._preloaded) is not None:
                    def make_engine() -> Engine:
                        return build_engine(config, runner=pre.runner(config, timeline), tokenizer=pre.tokenizer,
                                            timeline=timeline)
                elif (tokenizer := self._tokenizer) is not None:  # a warm process: the whole load, here
                    def make_engine() -> Engine:
                        return build_engine(config, tokenizer=tokenizer, timeline=timeline)
                self._server = await start_worker_server(
                    self._config, self._host, self._port, self._worker_id, num_threads=self._num_threads,
                    make_engine=make_engine, timeline=timeline, warm_up=self._preloaded is None)
                self._preloaded, self._tokenizer = None, None  # the engine owns the model and tokenizer now
                self._timelines["start"] = timeline
                logger.info("actor %s: %d torch threads, serving on %s (%s in %.2f s)", self._worker_id,
                            self._num_threads, self._server.endpoint, "promoted" if promoted else "started",
                            timeline.elapsed_s)
        return self._server.endpoint

    def startup(self) -> dict[str, object]:
        """This incarnation's start-up: ``init_at`` (monotonic time ``__init__`` began: the end of the
        cluster's schedule phase) and the timelines (workers/startup.py ``to_dict``) of ``prepare``
        (a standby's load) and ``start`` (a cold start, or a promotion), each None if not run."""
        return {"init_at": self._init_at, **{k: (t.to_dict() if (t := self._timelines.get(k)) else None)
                                             for k in ("prepare", "start")}}

    def rank_device(self) -> dict[str, object]:
        """The GPUs Ray assigned this worker and the device its engine config asks for."""
        return {"rank": 0, "gpu_ids": self._gpu_ids, "device": self._config.device}

    def ready(self) -> bool:
        """True once ``start()`` has finished and until ``stop()``."""
        return self._server is not None

    def endpoint(self) -> str | None:
        return self._server.endpoint if self._server is not None else None

    def info(self) -> dict[str, object]:
        """Identity for status pages: worker id, endpoint, incarnation, context limit (None until
        started), pid, torch threads, OpenMP wait policy and the nice values of its threads, the malloc tunables it
        started with, the Ray node it runs on (hex id)."""
        return {
            "worker_id": self._worker_id,
            "endpoint": self.endpoint(),
            "incarnation": self._server.incarnation if self._server is not None else None,
            "max_model_len": self._server.limits.max_model_len if self._server is not None else None,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "num_threads": self._num_threads,
            "omp_wait_policy": self._threads.omp_wait_policy,
            "niceness": sorted(thread_niceness()),  # of every thread of the process
            "glibc_tunables": self._threads.glibc_tunables,  # malloc's settings since start (memory_tuning)
            "gpu_ids": self._gpu_ids,
            "device": self._config.device,
            "standby": (self._preloaded is not None or self._tokenizer is not None) and self._server is None,
        }

    async def stop(self, grace: float = 5.0, migrate_to: list[tuple[str, str]] | None = None) -> None:
        """Drain for up to ``grace`` s, abort the rest (UNAVAILABLE), stop serving. Idempotent.
        migrate_to: (worker id, endpoint) of the pool's other workers: the running requests move
        there first by live migration (workers/handoff/drain.py), so the drain takes seconds."""
        server, self._server = self._server, None
        if server is not None:
            from protos.duet.worker.v1 import worker_pb2

            targets = [worker_pb2.MigrationTarget(worker_id=w, endpoint=e) for w, e in migrate_to or ()]
            await server.stop(grace, migrate_to=targets)
