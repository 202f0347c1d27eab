"""PrefixIndex: which prompt prefixes each worker *reports* holding in its prefix cache.

Every worker keeps a log of the prefix-cache blocks it stores and drops (workers/engine/block_events.py),
each named by its chain hash (workers/block_hash.py: 64 bits naming a block of ``kv_block_size``
tokens and everything before it). Each router reads that log on its load poll (router/workers.py:
``GetLoadRequest.block_events_since`` = its cursor, answered with the net change since, or a
snapshot), so N routers polling the same workers hold the same index, up to one poll interval, and
none of them guesses from what it alone sent. That is the routing state routers share: the workers
are its single source of truth, nothing is replicated between routers.

Terms:
    held(w)     the chain hashes worker w reported holding (a set).
    cursor(w)   (incarnation, block_seq) of the latest report applied; sent back on the next poll.
    match(P)    for each worker, the number of leading full blocks of prompt P it holds: the
                chain hash of block i names the whole prefix up to i, so one set lookup per block,
                stopping at the first miss.

Example (block_size 4)::

    index = PrefixIndex()
    index.apply("w0", "inc-a", BlockReport(seq=2, snapshot=True, stored=chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)),
                block_size=4)
    index.match([1, 2, 3, 4, 5, 6, 7, 0, 9])   # {"w0": 1}: the first block only

A worker that restarts (new incarnation) sends a snapshot (its cursor is refused); one that leaves
is forgotten (``forget``). Single event loop: all methods run on the router's loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from workers.block_hash import ROOT, chain_hashes


@dataclass(frozen=True)
class BlockReport:
    """The block-event part of one LoadReport (duet.worker.v1.LoadReport.block_*)."""

    seq: int
    snapshot: bool
    stored: Sequence[int] = ()
    removed: Sequence[int] = ()


@dataclass
class _Holdings:
    incarnation: str
    block_size: int
    seq: int = 0
    held: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _Holdings] = {}
        self.num_snapshots = 0  # reports applied as a full replacement
        self.num_diffs = 0

    def cursor(self, worker_id: str, incarnation: str = "") -> tuple[int, str]:
        """(block_events_since, block_events_incarnation) to send on the next poll of ``worker_id``."""
        h = self._workers.get(worker_id)
        return (h.seq, h.incarnation) if h is not None else (0, incarnation)

    def apply(self, worker_id: str, incarnation: str, report: BlockReport, *, block_size: int) -> None:
        """Apply one worker's report: a snapshot replaces its holdings, a diff updates them."""
        assert block_size > 0
        h = self._workers.get(worker_id)
        if report.snapshot or h is None or h.incarnation != incarnation or h.block_size != block_size:
            h = self._workers[worker_id] = _Holdings(incarnation, block_size, report.seq, set(report.stored))
            self.num_snapshots += 1
            return
        h.held.difference_update(report.removed)
        h.held.update(report.stored)
        h.seq = report.seq
        self.num_diffs += 1

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def knows(self, worker_id: str) -> bool:
        """True once ``worker_id`` reported its holdings (a worker without prefix caching never does)."""
        return worker_id in self._workers

    def match(self, token_ids: Sequence[int], workers: Iterable[str] | None = None, root: int = ROOT) -> dict[str, int]:
        """Leading full blocks of ``token_ids`` each known worker holds (workers holding none omitted).
        root: the chain's root (``adapter_root(adapter)`` for a request under a LoRA adapter)."""
        by_size: dict[int, list[int]] = {}
        out: dict[str, int] = {}
        for wid in (self._workers if workers is None else workers):
            h = self._workers.get(wid)
            if h is None or not h.held:
                continue
            hashes = by_size.get(h.block_size)
            if hashes is None:
                hashes = by_size[h.block_size] = chain_hashes(token_ids, h.block_size, root=root)
            n = 0
            for x in hashes:
                if x not in h.held:
                    break
                n += 1
            if n:
                out[wid] = n
        return out

    def block_size(self, worker_id: str) -> int:
        return self._workers[worker_id].block_size

    def num_blocks(self, worker_id: str | None = None) -> int:
        if worker_id is not None:
            h = self._workers.get(worker_id)
            return len(h.held) if h is not None else 0
        return sum(len(h.held) for h in self._workers.values())
