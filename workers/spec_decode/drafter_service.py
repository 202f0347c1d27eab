"""The drafter's process side: the ``duet.drafter.v1.Drafter`` gRPC service around a DraftEngine
(the Ray actor shell that hosts it is workers/spec_decode/drafter_actor.py; this module does not
import Ray, so a drafter also serves in a plain process).

One thread runs the engine (the server has a single worker thread), so calls are served in the
order they arrive: an overlapped draft for the next window (draft_model.py) is always finished
before the call that follows it, and the diffs of drafter.proto stay consistent.

Worked example (what draft_model.DraftModelProposer does)::

    actor = DrafterActor.options(num_cpus=1, resources={"drafter": 1}, max_restarts=-1).remote(
        "SmolLM2-135M-Instruct", "q4", target_engine_config, target_vocab_size)
    endpoint = ray.get(actor.start.remote())       # "10.0.0.7:40111"
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent import futures

import grpc
import torch

from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from workers.sampling_params import SamplingParams
from workers.spec_decode.drafter import DraftEngine, DraftItem

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # sampled drafts carry [K, V] float32 distributions
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]


def _params(s: drafter_pb2.Sampling) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                          seed=s.seed if s.HasField("seed") else None)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.incarnation = uuid.uuid4().hex[:12]

    def Propose(self, request: drafter_pb2.ProposeRequest, context: grpc.ServicerContext) -> drafter_pb2.ProposeResponse:
        t0 = time.perf_counter()
        try:
            items = [DraftItem(i.request_id, i.keep, list(i.new_token_ids), i.num_tokens, _params(i.sampling))
                     for i in request.items]
        except ValueError as e:  # InvalidRequestError is a ValueError: bad sampling fields
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        results = self.engine.propose(items)
        out = drafter_pb2.ProposeResponse(incarnation=self.incarnation)
        for r in results:
            d = out.drafts.add(request_id=r.request_id, token_ids=r.token_ids, resync=r.resync)
            if r.probs:
                probs = torch.stack(r.probs).float().contiguous()  # [K, V]
                d.probs = probs.numpy().tobytes()
                d.vocab_size = probs.shape[1]
        out.compute_seconds = time.perf_counter() - t0
        return out

    def Release(self, request: drafter_pb2.ReleaseRequest, context: grpc.ServicerContext) -> drafter_pb2.ReleaseResponse:
        for rid in request.request_ids:
            self.engine.release(rid)
        return drafter_pb2.ReleaseResponse()


def serve_drafter(engine: DraftEngine, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, str]:
    """Start the service on a free port (single engine thread); returns (server, "host:port")."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter"),
                         options=GRPC_OPTIONS)
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, f"{host}:{bound}"


def endpoint_connector(endpoint: str):
    """A Connector (draft_model.py) for a drafter already serving at ``endpoint`` (an in-process
    ``serve_drafter`` in tests and single-process use)."""
    return lambda: (lambda: endpoint)
