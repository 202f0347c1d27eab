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
``duet.worker.v1.Worker``, ``GetLoad`` with a fixed incarnation, cancellation, ``SubmitStream``), so an unmodified
router accepts it as a member. Its load report is honest about what it does: ``num_running``,
``outstanding_tokens`` (ids still to stream), and a stand-in prefix cache: each prompt's full
blocks of ``BLOCK_SIZE`` tokens are remembered (LRU, ``cache_blocks`` of them), counted as
prefix-cache queries and hits, and reported as block events (workers/engine/block_events.py) to
routers that ask (GetLoad) or watch (WatchBlocks), as a real worker reports its prefix cache: a
prompt's blocks as pending from its admission (workers/engine/block_events.py PendingBlocks), on
the device from its first token (a lookup counts them cached from admission on, as if a second
request for the same prefix always waited for the first one's prefill).

Run it on its own (it prints ``ECHO_WORKER_PORT=<port>`` once it listens)::

    python -m cluster.bench.echo_worker --port 0 --gap-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import uuid

from collections import OrderedDict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.server import wait_for_stop_signal
from workers.block_hash import chain_hashes
from workers.engine.block_events import BlockEventLog, PendingBlocks
from workers.server.block_watch import watch_blocks
from workers.server.submit_stream import SubmitStreams

SERVICE_NAME = "duet.worker.v1.Worker"
BLOCK_SIZE = 16  # tokens per stand-in KV block (the default engine block size)


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, first_token_ms: float = 0.0, gap_ms: float = 0.0, cache_blocks: int = 4096) -> None:
        self.first_token_s = first_token_ms / 1e3
        self.gap_s = gap_ms / 1e3
        self.incarnation = uuid.uuid4().hex
        self.running = 0
        self.outstanding = 0  # ids still to stream, over running requests
        self.cache_blocks = cache_blocks
        self.streams = SubmitStreams(self.Submit)  # SubmitStream (the router's transport), as a real worker
        self.events = BlockEventLog()
        self.pending = PendingBlocks(self.events)
        self._cached: OrderedDict[int, None] = OrderedDict()  # chain hash -> None, least recently used first
        self.prefix_queries = 0
        self.prefix_hits = 0

    def _lookup_and_store(self, prompt: list[int]) -> list[int]:
        """The stand-in prefix cache: count the prompt's leading cached blocks, then cache them all
        (reported pending); returns their hashes, for ``_computed``."""
        hashes = chain_hashes(prompt, BLOCK_SIZE)
        self.prefix_queries += len(hashes)
        self.prefix_hits += next((i for i, h in enumerate(hashes) if h not in self._cached), len(hashes))
        for h in hashes:
            self._cached[h] = None
            self._cached.move_to_end(h)
        self.pending.add(hashes)
        evicted = []
        while len(self._cached) > self.cache_blocks:
            evicted.append(self._cached.popitem(last=False)[0])
        self.events.removed(evicted)
        return hashes

    def _computed(self, hashes: list[int]) -> None:
        """The stand-in prefill is done: its blocks (still cached) are on the device, no longer pending."""
        self.events.stored([h for h in hashes if h in self._cached])
        self.pending.release(hashes)

    async def SubmitStream(self, request_iterator, context: grpc.aio.ServicerContext):
        async for batch in self.streams.serve(request_iterator):
            yield batch

    async def Submit(self, request: worker_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: must not be empty")
        n = max(1, request.sampling.max_tokens)
        ids = itertools.cycle(request.prompt_token_ids)
        pending = self._lookup_and_store(list(request.prompt_token_ids))
        self.running += 1
        self.outstanding += n
        sent = 0
        try:
            if self.first_token_s:
                await asyncio.sleep(self.first_token_s)
            self._computed(pending)
            pending = []
            for i in range(n):
                if i and self.gap_s:
                    await asyncio.sleep(self.gap_s)
                response = worker_pb2.SubmitResponse(token_ids=[next(ids)])
                if i == n - 1:
                    response.finish_reason = worker_pb2.FINISH_REASON_LENGTH
                    response.usage.prompt_tokens = len(request.prompt_token_ids)
                    response.usage.completion_tokens = n
                sent += 1
                self.outstanding -= 1
                yield response
        finally:
            if pending:  # cancelled before its first token
                self.pending.release(pending)
            self.running -= 1
            self.outstanding -= n - sent

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        return worker_pb2.AbortResponse(found=False)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        report = worker_pb2.LoadReport(worker_id="echo", incarnation=self.incarnation, submit_stream=True,
                                       num_running=self.running,
                                       outstanding_tokens=self.outstanding, kv_block_size=BLOCK_SIZE,
                                       kv_blocks_total=1 << 20, prefix_cache_queries=self.prefix_queries,
                                       prefix_cache_hits=self.prefix_hits)
        if request.block_events:
            since = request.block_events_since if request.block_events_incarnation == self.incarnation else 0
            diff = self.events.read(since)
            report.block_events_supported, report.block_seq, report.block_snapshot = True, diff.seq, diff.snapshot
            report.blocks_stored.extend(diff.stored)
            report.blocks_removed.extend(diff.removed)
            report.blocks_stored_tiers.extend(diff.stored_tiers)
        return report

    async def WatchBlocks(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        async for message in watch_blocks(self.events, request, self.incarnation, block_size=BLOCK_SIZE):
            yield message


async def start_echo_worker(host: str = "127.0.0.1", port: int = 0, *, first_token_ms: float = 0.0,
                            gap_ms: float = 0.0, worker: EchoWorker | None = None) -> tuple[grpc.aio.Server, int]:
    """Start an echo worker on the running loop (``worker``, or a new one with these delays);
    returns (server, bound port)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(worker or EchoWorker(first_token_ms, gap_ms), server)
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
