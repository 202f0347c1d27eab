"""The drafter's Ray actor shell: a DraftEngine behind the Drafter service (drafter_service.py) in
its own Ray worker process; lifecycle only, like workers/server/actor.py.

Worked example (what draft_model.DraftModelProposer does)::

    actor = DrafterActor.options(num_cpus=1, resources={"drafter": 1}, max_restarts=-1).remote(
        "SmolLM2-135M-Instruct", "q4", target_engine_config, target_vocab_size)
    endpoint = ray.get(actor.start.remote())       # "10.0.0.7:40111"
"""

from __future__ import annotations

import logging

import grpc
import ray
import torch

from workers.config import EngineConfig
from workers.models.assets.resolve import resolve_model
from workers.spec_decode.drafter import DraftEngine
from workers.spec_decode.drafter_service import serve_drafter

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=1)
class DrafterActor:
    """A DraftEngine behind the Drafter service in its own Ray worker process (Ray may put it on a
    CPU-only node through the resources it is created with). Threads: ``threads``, else the CPUs Ray
    reserved; draft_vocab_size: see DraftEngine."""

    def __init__(self, draft_model: str, quantization: str, target: EngineConfig,
                 target_vocab_size: int | None = None, draft_vocab_size: int = 0, threads: int = 0) -> None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        torch.set_num_threads(threads or max(1, int(cpus)))
        self._args = (draft_model, quantization, target, target_vocab_size, draft_vocab_size)
        self._server: grpc.Server | None = None
        self._endpoint = ""

    def start(self) -> str:
        """Load the draft model and serve; returns the endpoint. Idempotent."""
        if self._server is None:
            draft_model, *rest = self._args  # a name or Hub id becomes a checkpoint directory here, at the edge
            engine = DraftEngine.for_target(str(resolve_model(draft_model)), *rest)
            self._server, self._endpoint = serve_drafter(engine, ray.util.get_node_ip_address())
            logger.info("drafter serving on %s", self._endpoint)
        return self._endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0)
            self._server = None
