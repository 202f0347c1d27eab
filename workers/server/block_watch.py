"""WatchBlocks: push a worker's prefix-cache block events to a router as they happen.

GetLoad answers a router's poll with the block events since its cursor (workers/engine/block_events.py),
so N routers learn a new prefix one poll interval (0.2 s by default) after the worker stored it; a
prefix new to all of them can meanwhile be sent by each router to a different worker, each of which
then computes its own copy. ``watch_blocks`` is the push form: one server stream per router that
sends the diff since its cursor at once and then every change, coalesced while the reader is behind
(a listener on the log wakes the stream's task through the event loop). With pending blocks
(``PendingBlocks``: a prompt's blocks from admission until its first token, Tier.PENDING) every
router sees "this worker is computing that prefix" within milliseconds of its admission.

Example (the servicer's handler)::

    async def WatchBlocks(self, request, context):
        async for message in watch_blocks(self.events, request, self.incarnation, block_size=16):
            yield message
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from protos.duet.worker.v1 import worker_pb2
from workers.engine.block_events import BlockEventLog

logger = logging.getLogger(__name__)


async def watch_blocks(events: BlockEventLog, request: worker_pb2.GetLoadRequest, incarnation: str, *,
                       block_size: int) -> AsyncIterator[worker_pb2.BlockEvents]:
    """The stream of one WatchBlocks call (protos/duet/worker/v1/worker.proto): the diff (or snapshot)
    since the request's cursor, then one message per change, until the caller cancels."""
    assert block_size > 0
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def notify() -> None:  # on whichever thread recorded the event
        if changed.is_set():  # a wake-up is pending: its read (after the clear) will include this event
            return
        try:
            loop.call_soon_threadsafe(changed.set)
        except RuntimeError:  # the loop closed under a late record (shutdown): nobody to tell
            pass

    events.add_listener(notify)
    try:
        # A cursor from another incarnation means nothing here: read from 0 (a snapshot).
        since = request.block_events_since if request.block_events_incarnation == incarnation else 0
        first = True
        while True:
            changed.clear()
            diff = events.read(since)
            if first or diff.snapshot or diff.stored or diff.removed:
                yield worker_pb2.BlockEvents(incarnation=incarnation, kv_block_size=block_size, block_seq=diff.seq,
                                             block_snapshot=diff.snapshot, blocks_stored=diff.stored,
                                             blocks_removed=diff.removed, blocks_stored_tiers=diff.stored_tiers)
            first = False
            since = diff.seq
            await changed.wait()
    finally:
        events.remove_listener(notify)
