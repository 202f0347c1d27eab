"""BlockEventLog: what a worker's prefix cache gained and lost, for every router to read.

The block manager (workers/engine/block_manager.py) records each prefix-cache key it adds
(``stored``) and drops (``removed``: evicted, or the cache reset) as a chain hash
(workers/block_hash.py), on the engine thread. With lower KV tiers (workers/engine/kv_tiers.py) the
same hash is also stored in and removed from the host and disk tiers (``tier=``), so a block
evicted from the device into host memory is reported as moved, not lost. Routers read it through GetLoad
(``GetLoadRequest.block_events_since``, on the gRPC thread), each with its own cursor, so any
number of routers see the same holdings (router/prefix_index.py) without the worker tracking them.

Terms:
    seq        a counter bumped by every event; a reader's cursor is the seq it has seen up to.
    held       the hashes the cache holds now, each in the fastest tier holding it (Tier: device
               < host < disk); a block held in several tiers at once (a host copy of a block
               loaded back into the device stays in host) is reported once, in the fastest.
    diff       what changed since a cursor, net: hashes touched since then that are held now
               (stored, with their tier now) and that are not (removed). Order within a diff does
               not matter. A hash whose fastest tier changes (device -> host) is touched.
    snapshot   every held hash, for a reader with no cursor (0), a cursor of another incarnation
               or from the future, or one older than the log remembers (``capacity`` touched
               hashes; the oldest are forgotten first).

Example::

    log = BlockEventLog()
    log.stored([11, 12]); log.removed([11])
    log.read(0)       # BlockDiff(seq=3, snapshot=True, stored=[12], removed=[])
    log.stored([13])
    log.read(3)       # BlockDiff(seq=4, snapshot=False, stored=[13], removed=[])
    log.stored([13], Tier.HOST); log.removed([13])      # evicted from the device into host
    log.read(4)       # BlockDiff(seq=5, snapshot=False, stored=[13], removed=[], stored_tiers=[1])

Watchers (``add_listener``): a callback run after every record that changed what a reader sees
(outside the lock, on the recording thread), so a server can push diffs the moment they happen
(``duet.worker.v1.Worker/WatchBlocks``) instead of waiting for the next poll.

Pending blocks (``PendingBlocks``): the prompt blocks of requests admitted but not yet computed,
recorded under Tier.PENDING (refcounted: two requests sharing a new prefix keep it pending until
both released it). A router that sees them routes the same new prefix to the worker already
computing it (router/policies/prefix_aware.py) instead of starting a second copy elsewhere.

Thread-safe (one lock; the engine thread's appends are a few dict operations per step).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from workers.block_hash import Tier

DEFAULT_CAPACITY = 1 << 18  # touched hashes remembered (~20 MB at worst); older cursors get a snapshot


@dataclass(frozen=True)
class BlockDiff:
    """One read: ``stored``/``removed`` since the cursor, or (``snapshot``) every held hash in ``stored``.
    stored_tiers: the Tier of each ``stored`` hash, same order; empty when all are on the device
    (as LoadReport.blocks_stored_tiers)."""

    seq: int
    snapshot: bool
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    stored_tiers: list[int] = field(default_factory=list)


class BlockEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seq = 0
        self._held: dict[int, int] = {}  # hash -> bit mask of the tiers holding it (bit t: Tier t)
        self._touched: OrderedDict[int, int] = OrderedDict()  # hash -> seq of its latest event, oldest first
        self._forgotten_upto = 0  # events at or below this seq may be missing from _touched
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each record that bumps ``seq`` (on the recording thread, no lock
        held; it must be quick and thread-safe, e.g. ``loop.call_soon_threadsafe(event.set)``)."""
        with self._lock:
            self._listeners = [*self._listeners, callback]

    def remove_listener(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners = [c for c in self._listeners if c is not callback]

    @property
    def seq(self) -> int:
        return self._seq

    def num_held(self) -> int:
        return len(self._held)

    def tier(self, h: int) -> Tier | None:
        """The fastest tier holding ``h`` (None: none)."""
        mask = self._held.get(h, 0)
        return Tier((mask & -mask).bit_length() - 1) if mask else None

    def stored(self, hashes: Iterable[int], tier: Tier = Tier.DEVICE) -> None:
        self._record(hashes, tier, True)

    def removed(self, hashes: Iterable[int], tier: Tier = Tier.DEVICE) -> None:
        self._record(hashes, tier, False)

    def _record(self, hashes: Iterable[int], tier: Tier, held: bool) -> None:
        bit = 1 << tier
        with self._lock:
            seq0 = self._seq
            for h in hashes:
                old = self._held.get(h, 0)
                new = old | bit if held else old & ~bit
                if new == old:
                    continue
                if new:
                    self._held[h] = new
                else:
                    del self._held[h]
                if old & -old == new & -new:  # the fastest tier holding it is unchanged: nothing to report
                    continue
                self._seq += 1
                self._touched[h] = self._seq
                self._touched.move_to_end(h)
            while len(self._touched) > self.capacity:
                _, seq = self._touched.popitem(last=False)
                self._forgotten_upto = seq
            listeners = self._listeners if self._seq != seq0 else []
        for callback in listeners:
            callback()

    def read(self, since: int) -> BlockDiff:
        """The diff since cursor ``since`` (module docstring), or a snapshot."""
        with self._lock:
            if since <= 0 or since > self._seq or since < self._forgotten_upto:
                stored = list(self._held)
                return BlockDiff(self._seq, True, stored, [], self._tiers(stored))
            stored = []
            removed: list[int] = []
            for h in reversed(self._touched):
                if self._touched[h] <= since:
                    break
                (stored if h in self._held else removed).append(h)
            return BlockDiff(self._seq, False, stored, removed, self._tiers(stored))

    def _tiers(self, stored: list[int]) -> list[int]:
        """The fastest tier of each held hash; [] when all are on the device (lock held)."""
        masks = [self._held[h] for h in stored]
        if all(m & 1 for m in masks):
            return []
        return [(m & -m).bit_length() - 1 for m in masks]


class PendingBlocks:
    """The prompt blocks of admitted requests not computed yet, in ``events`` under Tier.PENDING.

    ``add(hashes)`` at admission, ``release(hashes)`` once the request's prompt is computed (its
    first token) or it ends; a hash stays pending while any request holds it. Thread-safe.

    Example::

        pending = PendingBlocks(log)
        pending.add([11, 12]); pending.add([11])
        pending.release([11, 12])     # 11 still pending (the second request)
        log.tier(11), log.tier(12)    # (Tier.PENDING, None)
    """

    def __init__(self, events: BlockEventLog) -> None:
        self.events = events
        self._lock = threading.Lock()
        self._count: dict[int, int] = {}

    def add(self, hashes: Iterable[int]) -> None:
        with self._lock:
            new = []
            for h in hashes:
                n = self._count.get(h, 0)
                self._count[h] = n + 1
                if not n:
                    new.append(h)
            self.events.stored(new, Tier.PENDING)

    def release(self, hashes: Iterable[int]) -> None:
        with self._lock:
            gone = []
            for h in hashes:
                n = self._count.get(h, 0)
                assert n > 0, f"PendingBlocks.release of {h:#x}, which is not pending"
                if n == 1:
                    del self._count[h]
                    gone.append(h)
                else:
                    self._count[h] = n - 1
            self.events.removed(gone, Tier.PENDING)

    def __len__(self) -> int:
        return len(self._count)
