"""The drafter's Ray actor shell: a DraftEngine behind the Drafter service (drafter_service.py) in
its own Ray worker process; lifecycle only, like workers/server/actor.py.

Two uses, one actor:
  pool replica   a ``role: drafter`` pool's replica (cluster/deploy/pools.py), named ``<pool>-<i>``
                 like a worker, started and probed by the controller (``start`` / ``info`` /
                 ``stop``), restarted by Ray; targets reach it through the router's pick.
  private        a worker's own drafter (speculative.method draft_model without drafter_pool),
                 created by draft_model.DraftModelProposer.from_config; it dies with the worker.

Worked example (a pool replica)::

    actor = DrafterActor.options(name="drafters-0", num_cpus=2, max_restarts=-1).remote(
        drafter_engine_config, worker_id="drafters-0")
    endpoint = ray.get(actor.start.remote())       # "10.0.0.7:40111"
    ray.get(actor.info.remote())["incarnation"]    # changes when Ray restarts it
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ray
import torch

from workers.config import EngineConfig
from workers.engine.device import resolve_for_rank
from workers.models.assets.resolve import resolve_model
from workers.spec_decode.drafter import DraftEngine
from workers.spec_decode.drafter_service import IDLE_TIMEOUT_S, DrafterServer, load_report, serve_drafter

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=1)
class DrafterActor:
    """A DraftEngine behind the Drafter service in its own Ray worker process (Ray may put it on a
    CPU-only node through the resources it is created with). Threads: ``threads``, else the CPUs Ray
    reserved. config: the drafter's EngineConfig (model = the draft checkpoint or name, resolved
    here); vocab_size: the target's (None = the drafter's; targets also send their own limit);
    draft_vocab_size: see DraftEngine; idle_timeout_s: requests without a round for this long are
    freed."""

    def __init__(self, config: EngineConfig, vocab_size: int | None = None, draft_vocab_size: int = 0,
                 threads: int = 0, *, worker_id: str = "", host: str | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        self._threads = threads or max(1, int(cpus))
        torch.set_num_threads(self._threads)
        self._config = config
        self._args = (vocab_size, draft_vocab_size)
        self._worker_id = worker_id
        self._host = host or ray.util.get_node_ip_address()
        self._idle_timeout_s = idle_timeout_s
        self._gpus = float(len(ray.get_gpu_ids()))
        self._server: DrafterServer | None = None
        self._endpoint: str | None = None

    def start(self) -> str:
        """Load the draft model and serve; returns the endpoint. Idempotent."""
        if self._server is None:
            # a name or Hub id becomes a checkpoint directory here, at the edge; a pool replica's device
            # auto -> the GPUs Ray assigned it (a private drafter follows its target's device)
            config = dataclasses.replace(self._config, model=str(resolve_model(self._config.model)))
            if self._worker_id:
                config = resolve_for_rank(config, self._gpus)
            engine = DraftEngine(config, *self._args)
            self._server, self._endpoint = serve_drafter(engine, self._host, worker_id=self._worker_id,
                                                         idle_timeout_s=self._idle_timeout_s)
            logger.info("drafter %s serving on %s (%d threads)", self._worker_id or "(private)", self._endpoint,
                        self._threads)
        assert self._endpoint is not None  # serving
        return self._endpoint

    def info(self) -> dict[str, object]:
        """What the controller probes and ``duet status`` shows (endpoint None until started)."""
        out: dict[str, object] = {"worker_id": self._worker_id, "role": "drafter", "endpoint": self._endpoint,
                                  "incarnation": None, "pid": os.getpid(),
                                  "node_id": ray.get_runtime_context().get_node_id(), "num_threads": self._threads,
                                  "model": self._config.model}
        if self._server is not None:
            s = self._server
            out["incarnation"] = s.scheduler.incarnation
            load = load_report(s.scheduler, self._worker_id, s.servicer.num_streams)
            out["load"] = {f.name: getattr(load, f.name) for f in load.DESCRIPTOR.fields}
        return out

    def stop(self, grace: float = 5.0, migrate_to: list[tuple[str, str]] | None = None) -> None:
        """Stop serving (targets' open rounds fail: their requests continue without drafts).
        migrate_to is accepted like a worker's and ignored: drafter state is a cache."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=0)
