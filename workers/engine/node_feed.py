"""NodeFeed: the node's shared host tier reported as this worker's own host holdings.

With ``cache.host_tier_shared`` every CPU worker of a node keeps its host tier in one shared
directory (workers/kv/tiers/node.py): a block any of them evicted there is a host hit for all.
To let routers count it as one, each worker reports it: a thread of its own reads the tier's
change feed (``TierStore.watch_shared``: the chain hashes of the blocks added and removed since
the last pass, whoever wrote or deleted them; the first pass names every block) every
``interval_s`` and records the diff in the worker's block event log (workers/engine/block_events.py)
as host-tier events. So

    * a block a neighbour put in the node tier is reported here within one interval, and a worker
      restarted on the node names the tier's holdings in its first report (the first pass runs
      at construction);
    * a block any worker deleted from the node tier (an eviction pass, a refusal) stops being
      reported within one interval, without waiting for a lookup to find it gone;
    * only diffs travel: a pass lists the directory and opens only the files it had not seen.

This worker's own moves (workers/engine/kv_tiers.py ``KVTiers``) are reported on the engine thread
as they happen; both reporters may name the same block. The log keeps one bit per tier and hash,
so a second ``stored`` or ``removed`` of the same bit changes nothing, and both converge on the
directory's contents within one interval. The engine ``claim``s each block it reports in host
(workers/kv/tiers/node.py ``NodeTier.claim``), so a block deleted before any pass listed its file
is still reported removed by the next pass, instead of the engine's claim standing for good.

Example::

    feed = NodeFeed(store, events, interval_s=1.0)   # first pass now, then a thread
    ...                                              # events hold every block of the node tier
    feed.close()                                     # thread stopped, its host claims removed
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from workers.block_hash import Tier
from workers.engine.block_events import BlockEventLog

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0  # a shared host tier's changes are reported within this long


class SharedTier(Protocol):
    def watch_shared(self) -> tuple[list[int], list[int]]:
        """(added, removed) chain hashes since the last call (the first call: every block)."""


class NodeFeed:
    def __init__(self, tier: SharedTier, events: BlockEventLog, interval_s: float = INTERVAL_S) -> None:
        assert interval_s > 0
        self._tier = tier
        self._events = events
        self._held: set[int] = set()  # the chain hashes this feed reported in host
        self._lock = threading.Lock()  # one pass at a time (the thread's, or a caller's ``poll``)
        self._stop = threading.Event()
        self.poll()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="kv-node-feed", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """One pass: report what the node tier gained and lost since the last one."""
        with self._lock:
            added, removed = self._tier.watch_shared()
            if removed:
                self._held.difference_update(removed)
                self._events.removed(removed, Tier.HOST)
            if added:
                self._held.update(added)
                self._events.stored(added, Tier.HOST)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.poll()
            except Exception:  # the next pass retries; routing lags meanwhile
                logger.exception("KV node tier: reporting its changes failed; retrying in %.1fs", interval_s)

    def close(self) -> None:
        """Stop the thread and withdraw this feed's host claims (the worker is leaving the node tier)."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._events.removed(self._held, Tier.HOST)
            self._held.clear()
