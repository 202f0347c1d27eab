"""Ray actor shells of a gang (several ranks acting as one worker): lifecycle only.

A gang of W ranks is W Ray actors in consecutive bundles of the pool's placement group:
  - ``GangLeaderActor`` (rank 0) is what the pool, the controller and the router see: the same
    interface as ``workers.server.actor.WorkerActor`` (start / ready / endpoint / info / stop) and one
    gRPC endpoint. Its engine thread joins the gang's process group, loads its shard of the model
    into a ModelRunner, wraps that in the gang's GangRunner (workers/engine/gang_runner.py), builds the
    engine over it (injected, never swapped afterwards) and serves.
  - ``GangFollowerActor`` (ranks 1..W-1) joins the same process group when the leader's ``start``
    tells it where (a fresh tcp:// rendezvous address each time), loads its shard into a ModelRunner
    (no engine: the leader schedules) and follows the leader's messages until told to stop.

Failure: when a rank dies, the next collective fails on the others (gloo sees the closed
connection; a stuck rank hits the collective timeout), so no call hangs. The leader's engine thread
then fails every in-flight request with UNAVAILABLE (workers/engine/loop.py), and a gang with a lost
rank cannot be repaired in place (a torch.distributed world has a fixed membership), so every rank
whose gang broke exits its process (after a short grace for the statuses to flush) and Ray restarts
it (``max_restarts``). The controller finds the leader restarted and calls ``start()`` again, which
re-forms the gang with the restarted followers: the pool recovers without operator action.

Worked example (cluster/deploy/pools.py does this per replica)::

    followers = [GangFollowerActor.options(...bundle i...).remote(cfg, ParallelConfig(ep_size=2), 1)]
    leader = GangLeaderActor.options(name="default-0", ...bundle 0...).remote(cfg, "default-0", None,
                                                                              ParallelConfig(ep_size=2), followers)
    endpoint = ray.get(leader.start.remote())
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from datetime import timedelta
from typing import Any

import ray

from workers.config import EngineConfig
from workers.build import build_engine
from workers.engine.engine import Engine
from workers.engine.model_runner import ModelRunner
from workers.errors import ConfigError
from workers.parallel.eplb import RebalanceConfig, Rebalancer
from workers.engine.gang_runner import GangRunner, follow
from workers.parallel.groups import AXES, ParallelConfig, destroy_parallel_groups, get_group, init_parallel_groups
from workers.parallel.launch import free_port
from workers.server.actor import rank_config
from workers.server.service import WorkerServer, start_worker_server
from workers.server.threads import apply as apply_threads

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=30)
EXIT_GRACE_S = 1.0  # time for UNAVAILABLE statuses to reach clients before a broken rank exits


def _threads(config: EngineConfig) -> int:
    """torch threads = the CPUs Ray reserved (at least 1); wait policy and niceness from the config
    (workers/server/threads.py)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    return apply_threads(config, max(1, int(cpus))).num_threads


def _exit_soon(reason: str) -> None:
    """A broken gang cannot be rejoined: leave the process to Ray, which restarts it."""
    logger.error("gang broken (%s); exiting so Ray restarts this rank", reason)
    threading.Timer(EXIT_GRACE_S, os._exit, args=(1,)).start()


@ray.remote(num_cpus=1)
class GangFollowerActor:
    """Rank ``rank`` (>= 1) of a gang. ``run`` blocks for the gang's lifetime."""

    def __init__(self, engine_config: EngineConfig, parallel: ParallelConfig, rank: int) -> None:
        self._num_threads = _threads(engine_config)
        self._config, self._parallel, self._rank = engine_config, parallel, rank
        self._gpu_ids = [str(g) for g in ray.get_gpu_ids()]  # what Ray assigned (it sets CUDA_VISIBLE_DEVICES)

    def rank_device(self) -> dict[str, object]:
        """The GPUs Ray assigned this rank and the device its engine config asks for."""
        return {"rank": self._rank, "gpu_ids": self._gpu_ids, "device": self._config.device}

    def run(self, init_method: str) -> int:
        """Join the gang at ``init_method``, follow the leader until it stops; returns steps run."""
        try:
            self._config = rank_config(self._config, float(len(self._gpu_ids)))
            init_parallel_groups(self._parallel, self._rank, init_method, timeout=COLLECTIVE_TIMEOUT,
                                 device=self._config.device)
            steps = follow(ModelRunner.from_config(self._config), get_group("gang"))
        except BaseException as e:  # any failure breaks the gang
            _exit_soon(f"rank {self._rank}: {e!r}")
            raise
        destroy_parallel_groups()
        return steps

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=1)
class GangLeaderActor:
    """Rank 0 of a gang: the engine's scheduler, the gRPC endpoint, the actor the pool manages."""

    def __init__(self, engine_config: EngineConfig, worker_id: str, host: str | None, parallel: ParallelConfig,
                 followers: list[Any], rebalance: RebalanceConfig | None = None, port: int = 0) -> None:
        self._num_threads = _threads(engine_config)
        self._config, self._worker_id, self._parallel = engine_config, worker_id, parallel
        self._gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self._host = host or ray.util.get_node_ip_address()
        self._port = port
        self._followers = followers
        self._rebalance = rebalance
        self._server: WorkerServer | None = None
        self._gang: GangRunner | None = None

    def _make_engine(self, init_method: str) -> Engine:
        """On the engine thread: join the gang, load this rank's shard, build the engine over the gang's runner."""
        init_parallel_groups(self._parallel, 0, init_method, timeout=COLLECTIVE_TIMEOUT, device=self._config.device)
        runner = ModelRunner.from_config(self._config)
        moe = getattr(runner.model, "moe_layers", None)
        if moe is None and self._parallel.ep_size > 1:
            raise ConfigError(f"ep_size={self._parallel.ep_size}: model_type {runner.spec.model_type!r} has no "
                              "experts to shard; use ep_size 1 for dense models")
        rebalancer = Rebalancer(moe(), self._rebalance) if moe is not None and self._rebalance else None
        self._gang = GangRunner(runner, get_group("gang"), rebalancer)
        return build_engine(self._config, runner=self._gang)

    async def start(self) -> str:
        """Form the gang, load, serve; returns the endpoint ("host:port"). Idempotent."""
        if self._server is None:
            # refused here (naming the key) before any follower joins: e.g. device cuda without CUDA
            self._config = await asyncio.to_thread(rank_config, self._config, float(len(self._gpu_ids)))
            init_method = f"tcp://{self._host}:{free_port()}"
            self._runs = [f.run.remote(init_method) for f in self._followers]
            self._server = await start_worker_server(
                self._config, self._host, self._port, self._worker_id, num_threads=self._num_threads,
                make_engine=lambda: self._make_engine(init_method))
            self._server.engine_done.add_done_callback(self._on_engine_exit)
            self._watch = asyncio.ensure_future(self._watch_followers(self._runs))
            logger.info("gang %s: %d ranks serving on %s", self._worker_id, self._parallel.world_size,
                        self._server.endpoint)
        return self._server.endpoint

    async def _watch_followers(self, runs: list) -> None:
        """A follower's ``run`` ends only when the leader stops it; ending any other way (its
        process died) breaks the gang even while idle, so leave for Ray to restart at once."""
        for done in asyncio.as_completed([asyncio.wrap_future(r.future()) for r in runs]):
            try:
                await done
            except Exception as e:  # noqa: BLE001 - RayActorError or the follower's own failure
                if self._server is not None:
                    _exit_soon(f"{self._worker_id}: a follower failed: {e!r}")
                return

    def _on_engine_exit(self, done: asyncio.Future) -> None:
        if done.result() is not None:
            _exit_soon(f"{self._worker_id}: engine failed: {done.result()!r}")

    def rank_device(self) -> dict[str, object]:
        """The GPUs Ray assigned this rank (rank 0) and the device its engine config asks for."""
        return {"rank": 0, "gpu_ids": self._gpu_ids, "device": self._config.device}

    def ready(self) -> bool:
        return self._server is not None

    def endpoint(self) -> str | None:
        return self._server.endpoint if self._server is not None else None

    def info(self) -> dict[str, object]:
        return {
            "worker_id": self._worker_id,
            "endpoint": self.endpoint(),
            "incarnation": self._server.incarnation if self._server is not None else None,
            "max_model_len": self._server.limits.max_model_len if self._server is not None else None,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),  # the leader's (rank 0's) node
            "num_threads": self._num_threads,
            "gang_size": self._parallel.world_size,
            # what carries each axis's collectives: 'shm' (same host), 'gloo'/'nccl', or 'none'
            "transports": {axis: get_group(axis).transport for axis in AXES},
        }

    async def stop(self, grace: float = 5.0) -> None:
        """Drain, stop serving, release the followers. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace)  # joins the engine thread: the gang is idle from here on
        if self._gang is not None and server.engine_done.result() is None:
            try:
                self._gang.stop()
            except Exception as e:  # noqa: BLE001 - a follower already gone: nothing to release
                logger.warning("gang %s: could not stop followers: %r", self._worker_id, e)
        destroy_parallel_groups()
