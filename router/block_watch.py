"""BlockWatch: one worker's prefix-cache block events, pushed to this router as they happen.

The load poll (router/workers.py, every ``load_poll_interval_s``) carries a worker's block events
since this router's cursor, so a router learns what the others routed one poll after the worker
stored it. Several routers that each see a new prefix inside that window send it to different
workers, each of which then computes its own copy (the prefix-hit gap of 3 routers against 1,
benchmarks/README.md ``routers_bench.py``). A BlockWatch keeps ``duet.worker.v1.Worker/WatchBlocks``
open instead: the worker pushes each change (workers/server/block_watch.py), including a prompt's
blocks as *pending* (Tier.PENDING) from the moment it admits the request, and the watch applies it
to the router's PrefixIndex on arrival: every router sees "w1 is computing this prefix" within
milliseconds of w1's admission.

Terms:
    watching   the stream is open and its first message was applied: the load poll then asks for
               no block events (two feeds of one index could cross; PrefixIndex also drops a
               report older than what it applied).
    retry      a broken stream (the worker restarting, unreachable) is reopened after
               ``retry_s``; meanwhile the poll carries the block events again.

A worker that does not serve WatchBlocks (UNIMPLEMENTED: no prefix caching, an older worker) is
told once in the log and counted (``WorkerDirectory.num_block_watch_unsupported``); its holdings
come from the poll as before.

Example (what WorkerDirectory does per member)::

    watch = BlockWatch("w0", stub, index, retry_s=0.2, on_unsupported=directory.count_unsupported)
    watch.start()
    ...
    watch.stop()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.prefix_index import BlockReport, PrefixIndex

logger = logging.getLogger(__name__)


class BlockWatch:
    def __init__(self, worker_id: str, stub: worker_pb2_grpc.WorkerStub, index: PrefixIndex, *, retry_s: float,
                 incarnation: Callable[[], str] = lambda: "", on_unsupported: Callable[[str], None] | None = None) -> None:
        self.worker_id = worker_id
        self._stub = stub
        self._index = index
        self._retry_s = retry_s
        self._incarnation = incarnation  # the member's last reported incarnation (cursor of a first watch)
        self._on_unsupported = on_unsupported
        self._task: asyncio.Task[None] | None = None
        self.watching = False
        self.num_messages = 0
        self.num_reconnects = 0

    def start(self) -> None:
        assert self._task is None, "BlockWatch.start() called twice"
        self._task = asyncio.create_task(self._run(), name=f"block-watch-{self.worker_id}")

    def stop(self) -> asyncio.Task[None] | None:
        """Cancel the stream; returns the task to await (None if never started)."""
        self.watching = False
        if self._task is not None:
            self._task.cancel()
        return self._task

    async def _run(self) -> None:
        while True:
            try:
                await self._stream()
                reason = "the worker ended the stream"
            except asyncio.CancelledError:
                self.watching = False
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.watching = False
                    logger.warning("worker %s serves no WatchBlocks (%s): its prefix holdings come from the "
                                   "load poll only", self.worker_id, e.details())
                    if self._on_unsupported is not None:
                        self._on_unsupported(self.worker_id)
                    return
                reason = f"{e.code().name}: {e.details()}"
            self.watching = False
            self.num_reconnects += 1
            logger.debug("worker %s: block watch broke (%s); the poll carries block events until it reopens",
                         self.worker_id, reason)
            await asyncio.sleep(self._retry_s)

    async def _stream(self) -> None:
        since, incarnation = self._index.cursor(self.worker_id, self._incarnation())
        request = worker_pb2.GetLoadRequest(block_events=True, block_events_since=since,
                                            block_events_incarnation=incarnation)
        async for msg in self._stub.WatchBlocks(request):
            if msg.kv_block_size:
                self._index.apply(self.worker_id, msg.incarnation,
                                  BlockReport(msg.block_seq, msg.block_snapshot, msg.blocks_stored,
                                              msg.blocks_removed, msg.blocks_stored_tiers),
                                  block_size=msg.kv_block_size)
            self.num_messages += 1
            self.watching = True
