"""A zero-compute ``duet.worker.v1`` worker, for measuring the router's own latency.

Against a real engine the router's added latency (a fraction of a millisecond) drowns in the
engine's own step-to-step jitter (a 40-token prefill varies by ±10 ms on a busy 2-core machine),
so hundreds of paired requests would be needed to see it. This worker does no model work: it
answers ``Submit`` with ``max_tokens`` ids at a fixed pace, so router-vs-direct differences
measure the extra gRPC hop, the router's preprocessing, routing and detokenization, and nothing else.

Terms:
    first_token_ms  delay before the first streamed id (a stand-in prefill; 0 = answer at once)
    gap_ms          delay between later ids (a stand-in decode step)

Streamed ids cycle through the request's own prompt ids, so they are always valid for the
tokenizer the router detokenizes with. It speaks the real protocol (health SERVING for
``duet.worker.v1.Worker``, ``GetLoad`` with a fixed incarnation, cancellation), so an unmodified
router accepts it as a member.

Run it on its own (it prints ``ECHO_WORKER_PORT=<port>`` once it listens)::

    python -m cluster.bench.echo_worker --port 0 --gap-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.server import wait_for_stop_signal

SERVICE_NAME = "duet.worker.v1.Worker"


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, first_token_ms: float = 0.0, gap_ms: float = 0.0) -> None:
        self.first_token_s = first_token_ms / 1e3
        self.gap_s = gap_ms / 1e3
        self.incarnation = uuid.uuid4().hex
        self.running = 0

    async def Submit(self, request: worker_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: must not be empty")
        n = max(1, request.sampling.max_tokens)
        ids = itertools.cycle(request.prompt_token_ids)
        self.running += 1
        try:
            if self.first_token_s:
                await asyncio.sleep(self.first_token_s)
            for i in range(n):
                if i and self.gap_s:
                    await asyncio.sleep(self.gap_s)
                response = worker_pb2.SubmitResponse(token_ids=[next(ids)])
                if i == n - 1:
                    response.finish_reason = worker_pb2.FINISH_REASON_LENGTH
                    response.usage.prompt_tokens = len(request.prompt_token_ids)
                    response.usage.completion_tokens = n
                yield response
        finally:
            self.running -= 1

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        return worker_pb2.AbortResponse(found=False)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        return worker_pb2.LoadReport(worker_id="echo", incarnation=self.incarnation, num_running=self.running,
                                     kv_block_size=16, kv_blocks_total=1 << 20)


async def start_echo_worker(host: str = "127.0.0.1", port: int = 0, *, first_token_ms: float = 0.0,
                            gap_ms: float = 0.0) -> tuple[grpc.aio.Server, int]:
    """Start an echo worker on the running loop; returns (server, bound port)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(EchoWorker(first_token_ms, gap_ms), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"echo worker: cannot listen on {host}:{port}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def _main(args: argparse.Namespace) -> None:
    server, port = await start_echo_worker(args.host, args.port, first_token_ms=args.first_token_ms,
                                           gap_ms=args.gap_ms)
    print(f"ECHO_WORKER_PORT={port}", flush=True)
    await wait_for_stop_signal()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.echo_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as ECHO_WORKER_PORT=...)")
    p.add_argument("--first-token-ms", type=float, default=0.0, help="delay before the first id")
    p.add_argument("--gap-ms", type=float, default=0.0, help="delay between later ids")
    asyncio.run(_main(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
