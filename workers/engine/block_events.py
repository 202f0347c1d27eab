"""BlockEventLog: what a worker's prefix cache gained and lost, for every router to read.

The block manager (workers/engine/block_manager.py) records each prefix-cache key it adds
(``stored``) and drops (``removed``: evicted, or the cache reset) as a chain hash
(workers/block_hash.py), on the engine thread. Routers read it through GetLoad
(``GetLoadRequest.block_events_since``, on the gRPC thread), each with its own cursor, so any
number of routers see the same holdings (router/prefix_index.py) without the worker tracking them.

Terms:
    seq        a counter bumped by every event; a reader's cursor is the seq it has seen up to.
    held       the hashes the cache holds now.
    diff       what changed since a cursor, net: hashes touched since then that are held now
               (stored) and that are not (removed). Order within a diff does not matter.
    snapshot   every held hash, for a reader with no cursor (0), a cursor of another incarnation
               or from the future, or one older than the log remembers (``capacity`` touched
               hashes; the oldest are forgotten first).

Example::

    log = BlockEventLog()
    log.stored([11, 12]); log.removed([11])
    log.read(0)       # BlockDiff(seq=3, snapshot=True, stored=[12], removed=[])
    log.stored([13])
    log.read(3)       # BlockDiff(seq=4, snapshot=False, stored=[13], removed=[])

Thread-safe (one lock; the engine thread's appends are a few dict operations per step).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_CAPACITY = 1 << 18  # touched hashes remembered (~20 MB at worst); older cursors get a snapshot


@dataclass(frozen=True)
class BlockDiff:
    """One read: ``stored``/``removed`` since the cursor, or (``snapshot``) every held hash in ``stored``."""

    seq: int
    snapshot: bool
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class BlockEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seq = 0
        self._held: set[int] = set()
        self._touched: OrderedDict[int, int] = OrderedDict()  # hash -> seq of its latest event, oldest first
        self._forgotten_upto = 0  # events at or below this seq may be missing from _touched

    @property
    def seq(self) -> int:
        return self._seq

    def num_held(self) -> int:
        return len(self._held)

    def stored(self, hashes: Iterable[int]) -> None:
        self._record(hashes, True)

    def removed(self, hashes: Iterable[int]) -> None:
        self._record(hashes, False)

    def _record(self, hashes: Iterable[int], held: bool) -> None:
        with self._lock:
            for h in hashes:
                if (h in self._held) == held:
                    continue
                if held:
                    self._held.add(h)
                else:
                    self._held.discard(h)
                self._seq += 1
                self._touched[h] = self._seq
                self._touched.move_to_end(h)
            while len(self._touched) > self.capacity:
                _, seq = self._touched.popitem(last=False)
                self._forgotten_upto = seq

    def read(self, since: int) -> BlockDiff:
        """The diff since cursor ``since`` (module docstring), or a snapshot."""
        with self._lock:
            if since <= 0 or since > self._seq or since < self._forgotten_upto:
                return BlockDiff(self._seq, True, list(self._held))
            stored: list[int] = []
            removed: list[int] = []
            for h in reversed(self._touched):
                if self._touched[h] <= since:
                    break
                (stored if h in self._held else removed).append(h)
            return BlockDiff(self._seq, False, stored, removed)
