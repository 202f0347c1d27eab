"""PrefixIndex: which prompt prefixes each worker *reports* holding in its prefix cache.

Every worker keeps a log of the prefix-cache blocks it stores and drops (workers/engine/block_events.py),
each named by its chain hash (workers/block_hash.py: 64 bits naming a block of ``kv_block_size``
tokens and everything before it). Each router reads that log on its load poll (router/workers.py:
``GetLoadRequest.block_events_since`` = its cursor, answered with the net change since, or a
snapshot), so N routers polling the same workers hold the same index, up to one poll interval, and
none of them guesses from what it alone sent. That is the routing state routers share: the workers
are its single source of truth, nothing is replicated between routers.

Terms:
    held(w)     the chain hashes worker w reported holding, each with the tier it holds it in
                (workers/block_hash.py Tier: its device cache, host memory or local disk; the
                fastest when several: LoadReport.blocks_stored_tiers, all device when absent).
    cursor(w)   (incarnation, block_seq) of the latest report applied; sent back on the next poll.
    match(P)    for each worker, the number of leading full blocks of prompt P it holds (in any
                tier): the chain hash of block i names the whole prefix up to i, so one dict
                lookup per block, stopping at the first miss. ``match_tiers`` gives the tier of
                each of those blocks (the prefix-aware policy weighs them).

Example (block_size 4)::

    index = PrefixIndex()
    index.apply("w0", "inc-a", BlockReport(seq=2, snapshot=True, stored=chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)),
                block_size=4)
    index.match([1, 2, 3, 4, 5, 6, 7, 0, 9])   # {"w0": 1}: the first block only
    index.apply("w0", "inc-a", BlockReport(seq=3, snapshot=False, stored=chain_hashes([1, 2, 3, 4], 4),
                stored_tiers=[Tier.HOST]), block_size=4)   # the first block moved to host memory
    index.match_tiers([1, 2, 3, 4, 5, 6, 7, 8, 9])   # {"w0": [Tier.HOST, Tier.DEVICE]}

A worker that restarts (new incarnation) sends a snapshot (its cursor is refused); one that leaves
is forgotten (``forget``). A report older than the one applied (same incarnation, lower seq) is
stale and dropped: the load poll and the pushed stream (router/block_watch.py) can cross.
Pending blocks (Tier.PENDING: a prompt the worker admitted and has not computed yet) count in
``match_tiers`` (the prefix-aware policy routes to the worker computing a prefix) but not in
``match`` (nothing can be pulled from a block that is not there yet). Single event loop: all methods run on the router's loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from workers.block_hash import ROOT, Tier, chain_hashes


@dataclass(frozen=True)
class BlockReport:
    """The block-event part of one LoadReport (duet.worker.v1.LoadReport.block_*).
    stored_tiers: the Tier of each ``stored`` hash, same order; empty = all on the device."""

    seq: int
    snapshot: bool
    stored: Sequence[int] = ()
    removed: Sequence[int] = ()
    stored_tiers: Sequence[int] = ()

    def held(self) -> dict[int, int]:
        """stored hash -> its tier."""
        if not self.stored_tiers:
            return dict.fromkeys(self.stored, int(Tier.DEVICE))
        assert len(self.stored_tiers) == len(self.stored), "one tier per stored hash"
        return dict(zip(self.stored, self.stored_tiers))


@dataclass
class _Holdings:
    incarnation: str
    block_size: int
    seq: int = 0
    held: dict[int, int] = field(default_factory=dict)  # chain hash -> Tier
    pending: int = 0  # entries of ``held`` in Tier.PENDING

    def count_pending(self) -> None:
        self.pending = sum(1 for t in self.held.values() if t == Tier.PENDING)


class PrefixIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _Holdings] = {}
        self.num_snapshots = 0  # reports applied as a full replacement
        self.num_diffs = 0
        self.num_stale = 0  # reports dropped as older than the one applied

    def cursor(self, worker_id: str, incarnation: str = "") -> tuple[int, str]:
        """(block_events_since, block_events_incarnation) to send on the next poll of ``worker_id``."""
        h = self._workers.get(worker_id)
        return (h.seq, h.incarnation) if h is not None else (0, incarnation)

    def apply(self, worker_id: str, incarnation: str, report: BlockReport, *, block_size: int) -> None:
        """Apply one worker's report: a snapshot replaces its holdings, a diff updates them."""
        assert block_size > 0
        h = self._workers.get(worker_id)
        if h is not None and h.incarnation == incarnation and h.block_size == block_size and report.seq < h.seq:
            self.num_stale += 1
            return
        if report.snapshot or h is None or h.incarnation != incarnation or h.block_size != block_size:
            h = self._workers[worker_id] = _Holdings(incarnation, block_size, report.seq, report.held())
            h.count_pending()
            self.num_snapshots += 1
            return
        pending = Tier.PENDING
        for x in report.removed:
            h.pending -= h.held.pop(x, None) == pending
        for x, t in report.held().items():
            h.pending += (t == pending) - (h.held.get(x) == pending)
            h.held[x] = t
        h.seq = report.seq
        self.num_diffs += 1

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def knows(self, worker_id: str) -> bool:
        """True once ``worker_id`` reported its holdings (a worker without prefix caching never does)."""
        return worker_id in self._workers

    def match(self, token_ids: Sequence[int], workers: Iterable[str] | None = None, root: int = ROOT) -> dict[str, int]:
        """Leading full blocks of ``token_ids`` each known worker holds, pending ones not counted
        (workers holding none omitted).
        root: the chain's root (``adapter_root(adapter)`` for a request under a LoRA adapter)."""
        out = {}
        for wid, tiers in self.match_tiers(token_ids, workers, root).items():
            n = next((i for i, t in enumerate(tiers) if t == Tier.PENDING), len(tiers))
            if n:
                out[wid] = n
        return out

    def match_tiers(self, token_ids: Sequence[int], workers: Iterable[str] | None = None,
                    root: int = ROOT) -> dict[str, list[int]]:
        """The Tier of each leading full block of ``token_ids`` each known worker holds (as ``match``)."""
        by_size: dict[int, list[int]] = {}
        out: dict[str, list[int]] = {}
        for wid in (self._workers if workers is None else workers):
            h = self._workers.get(wid)
            if h is None or not h.held:
                continue
            hashes = by_size.get(h.block_size)
            if hashes is None:
                hashes = by_size[h.block_size] = chain_hashes(token_ids, h.block_size, root=root)
            tiers: list[int] = []
            for x in hashes:
                tier = h.held.get(x)
                if tier is None:
                    break
                tiers.append(tier)
            if tiers:
                out[wid] = tiers
        return out

    def pending_tokens(self, worker_id: str) -> int:
        """Prompt tokens ``worker_id`` reports admitted and not computed yet (its pending blocks):
        load that its last load report may not show yet."""
        h = self._workers.get(worker_id)
        return h.pending * h.block_size if h is not None else 0

    def block_size(self, worker_id: str) -> int:
        return self._workers[worker_id].block_size

    def num_blocks(self, worker_id: str | None = None) -> int:
        if worker_id is not None:
            h = self._workers.get(worker_id)
            return len(h.held) if h is not None else 0
        return sum(len(h.held) for h in self._workers.values())
