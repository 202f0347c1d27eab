"""KV tiers below the device cache: what the engine does with them (the stores live in workers/kv/tiers/).

Terms:
    device tier   the runner's block pool (GPU or CPU memory): what the block manager allocates
    lower tiers   host memory, then local disk: each with a byte budget, least recently used first
                  out (LRU); a ``TierStore`` (workers/kv/tiers/store.py) owns them
    digest        a block's identity below the device: 16 bytes, XXH3-128 over the parent block's
                  digest and the block's token ids (so it names the whole prefix, as the block
                  manager's chained key does): ``next_digest``, ``key_digest``. Not the 64-bit chain
                  hash the block events report (workers/block_hash.py), although both name the same
                  prefix: the device reuses a block only after comparing its tokens (the key), so a
                  chain-hash collision costs a routing guess; below the device the digest *is* the
                  identity (no tokens are kept to compare), so a collision would serve another
                  prefix's KV. The chain hash is Python's tuple hash, not collision-resistant; the
                  digest is 128 bits of XXH3. Each block below the device carries both (the hash
                  only to report its moves), so the tiers hash a prefix a second time, once per
                  eviction and per admission lookup, a cost far below the copy it accompanies
    park          a new request whose prefix continues on disk waits outside the scheduler until
                  those reads are done or ``cache.tier_load_timeout_s`` passes (then it recomputes);
                  the step loop never waits on disk

The data flow (one direction per event):
    eviction      the block manager evicts a prefix-cached block (workers/engine/block_manager.py
                  ``on_evict``) -> ``KVTiers.evicted`` copies it out of the runner at once (the
                  block is about to be overwritten) and keeps the copy pending; ``flush``, at the
                  start of the next step (``take_ready``) or before anything looks below the device
                  (``match``, ``prefetch``, ``read_prefix``), stores it in host (its checksum and the
                  model fingerprint are attached by the store); host's LRU spills to disk on the
                  store's writer thread; disk's LRU is deleted. So the sealing, the host (or node
                  tier file) writes and the spills an admission's evictions cause run after the step
                  that returns its first token, not before it
    reporting     every move below the device (into host, spilled to disk, read back into host,
                  deleted, refused) is a block event (workers/engine/block_events.py) under the
                  block's chain hash (workers/block_hash.py) with its tier, in the log the block
                  manager reports the device in: routers see host and disk holdings as such
                  (router/prefix_index.py), not as losses; a block loaded back into the device is
                  stored on the device again by the block manager when the scheduler keys it
    node feed     with the node's shared host tier (workers/kv/tiers/node.py), workers/engine/node_feed.py
                  reports its change feed every ``watch_interval_s``: every worker of the node
                  reports every block in the node tier as held in host, whoever put it there, and
                  stops reporting one a neighbour deleted within that interval
    admission     the scheduler takes device prefix hits, then asks ``match`` for the blocks that
                  continue the prefix in host memory (verified: a corrupt or foreign block ends the
                  match there, is counted and recomputed), allocates, and ``PrefixLoad.write`` copies
                  them into the new blocks; they count as cached tokens, not computed ones
    new request   ``prefetch`` starts disk reads of its prefix blocks (they land in host) and parks it
    preemption    swap instead of recompute: a preempted request's full blocks stay prefix-cached;
                  if they are evicted before it resumes they go to host like any other, and its
                  resume loads them back by the same admission path (only its last partial block,
                  < block_size tokens, is recomputed)

When recompute is cheaper: loading a block costs one host copy plus one checksum; recomputing it
costs block_size tokens of prefill. ``match`` loads while the measured load time per block (an
exponential average of ``write`` calls) is at most the measured prefill time of block_size tokens
(fed by the engine from each step's shape and time, ``observe_prefill``); before both are measured
it loads. Figures: benchmarks/README.md (kv_tiers).

Worked example (block_size 4, device cache of 2 blocks, host tier on)::

    A = [1..12] computes blocks a0 a1 a2; B = [20..31] evicts a0, a1 (-> host, digests d(a0), d(a1))
    A' = A + [13] arrives: the device has no hit, ``match`` finds d(a0), d(a1), d(a2)... in host,
    the scheduler allocates 4 blocks and writes 2-3 of them from host; only the rest is computed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
import xxhash

from workers.block_hash import Tier
from workers.engine.block_events import BlockEventLog
from workers.engine.node_feed import INTERVAL_S as NODE_FEED_INTERVAL_S
from workers.engine.node_feed import NodeFeed
from workers.engine.block_manager import root_key
from workers.engine.sequence import Sequence

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
ROOT_DIGEST = bytes(DIGEST_BYTES)  # the parent of a prompt's first block


def next_digest(parent: bytes, tokens: tuple[int, ...] | list[int]) -> bytes:
    """The digest of a block with these token ids whose parent block has digest ``parent``."""
    h = xxhash.xxh3_128(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())  # int64 little-endian, as torch.int64's bytes
    return h.digest()


def root_digest(root: int | None) -> bytes:
    """The parent digest of a prompt's first block: ROOT_DIGEST for the base model, else derived
    from the LoRA adapter's chain root (workers/engine/block_manager.py ``root_key``), so a block
    computed under an adapter never matches the base model's or another adapter's below the device."""
    return ROOT_DIGEST if root is None else root.to_bytes(8, "little") + bytes(DIGEST_BYTES - 8)


def key_digest(key: tuple) -> bytes:
    """The digest of a block manager key ``(parent key | root, tokens)`` (walks its chain)."""
    chain = []
    node: tuple | int | None = key
    while isinstance(node, tuple):
        chain.append(node[1])
        node = node[0]
    digest = root_digest(node)
    for tokens in reversed(chain):
        digest = next_digest(digest, tokens)
    return digest


class KeyDigests:
    """``key_digest`` with a memo of the keys it walked: an evicted block's digest costs one
    ``next_digest`` when its parent's is remembered, instead of a walk of its whole chain (~4 us a
    level). Entries are keyed by the key object's identity and keep the key alive (so an id is never
    reused while its entry stands); the oldest ``capacity`` entries are kept."""

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._memo: OrderedDict[int, tuple[tuple, bytes]] = OrderedDict()  # id(key) -> (key, digest)

    def __call__(self, key: tuple) -> bytes:
        chain: list[tuple] = []
        node: tuple | int | None = key
        digest = None
        while isinstance(node, tuple):
            hit = self._memo.get(id(node))
            if hit is not None and hit[0] is node:
                digest = hit[1]
                break
            chain.append(node)
            node = node[0]
        if digest is None:
            assert not isinstance(node, tuple)  # the walk reached the chain's root
            digest = root_digest(node)
        for k in reversed(chain):
            digest = next_digest(digest, k[1])
            self._memo[id(k)] = (k, digest)
        while len(self._memo) > self.capacity:
            self._memo.popitem(last=False)
        return digest


@dataclass(frozen=True)
class TierStats:
    """Counters of the lower tiers since start (bytes are KV payload bytes)."""

    host_capacity_bytes: int = 0
    host_bytes: int = 0
    host_blocks: int = 0
    disk_capacity_bytes: int = 0
    disk_bytes: int = 0
    disk_blocks: int = 0
    host_hits: int = 0  # blocks loaded back into the device from host
    disk_hits: int = 0  # blocks read back from disk into host
    stored_blocks: int = 0  # blocks evicted from the device into host (or disk without a host tier)
    bytes_to_host: int = 0
    bytes_to_disk: int = 0
    bytes_loaded: int = 0  # host -> device
    host_evictions: int = 0  # host LRU out (spilled to disk, or dropped without a disk tier)
    disk_evictions: int = 0  # disk LRU out (deleted)
    refused_corrupt: int = 0  # checksum, size or digest mismatch: dropped and recomputed
    refused_foreign: int = 0  # another model's fingerprint or KV layout: dropped and recomputed
    disk_errors: int = 0  # write or read failures (the block is dropped)
    deadline_misses: int = 0  # parked requests admitted with disk reads still in flight (recompute)
    load_seconds: float = 0.0  # host -> device copy and verification time


class TierStore(Protocol):
    """The lower tiers as the engine sees them (workers/kv/tiers/store.py ``TieredStore``).
    Digests are ``next_digest`` chains; kv is one block, [L, 2, 1, bs, G, D] on the CPU."""

    shared: bool  # the host tier is the node's, shared with other processes (``watch_shared``)

    def put(self, digest: bytes, kv: torch.Tensor, chain_hash: int) -> None:
        """Keep an evicted block (its checksum and the fingerprint are attached here; the chain
        hash goes with it, for the node's other workers to report it)."""

    def where(self, digest: bytes) -> str | None:
        """'host', 'disk' or None."""

    def touch(self, digest: bytes) -> None:
        """Mark a host-resident block most recently used."""

    def get(self, digest: bytes) -> torch.Tensor | None:
        """A host-resident block, verified (None: absent, or refused: counted and dropped)."""

    def prefetch(self, digest: bytes) -> bool:
        """Start reading a disk-resident block into host; True while such a read is in flight."""

    def read_disk(self, digest: bytes) -> concurrent.futures.Future | None:
        """Start reading a disk-resident block without moving it into host (None: not on disk):
        the Future gives the verified TierBlock or raises BlockRefused."""

    def poll(self) -> None:
        """Move finished disk reads into host (engine thread)."""

    def wait(self, timeout: float) -> None:
        """Sleep until a disk read finishes or ``timeout`` seconds pass."""

    def claim_shared(self, digest: bytes, chain_hash: int) -> None:
        """Only when ``shared``: this engine reported the block in the shared host tier itself, so
        the change feed (``watch_shared``) reports its removal even if no pass saw its file."""

    def changes(self) -> list[tuple[bytes, int]]:
        """(digest, chain hash) of the blocks whose tiers changed since the last call; the hash is
        that of the block as it moved (a node-tier block another worker put there and that this
        store spilled to its disk), or 0 when not at hand."""

    def watch_shared(self) -> tuple[list[int], list[int]]:
        """Only when ``shared``: the chain hashes of blocks added to and removed from the shared
        host tier since the last call, by any process (the first call: all). Off the engine thread."""

    def count_deadline_miss(self) -> None: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Stop the disk thread and remove every file and segment this store made."""


class BlockIO(Protocol):
    """What the tiers need from the runner (workers/engine/runner.py ``Runner``)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None: ...


@dataclass
class _Parked:
    seq: Sequence
    digests: list[bytes]  # disk reads it waits for
    deadline: float


@dataclass
class PrefixLoad:
    """Blocks found in host for one admission: ``write`` copies them into the allocated blocks."""

    tiers: KVTiers
    kv: list[torch.Tensor] = field(default_factory=list)  # each [L, 2, 1, bs, G, D]
    verify_s: float = 0.0  # time spent finding and verifying them (part of the load's cost)

    @property
    def num_blocks(self) -> int:
        return len(self.kv)

    def write(self, block_ids: list[int]) -> None:
        """Each block straight from its tier copy into its device block: no concatenated staging
        tensor (allocating and filling one cost as much as the writes themselves on the CPU)."""
        assert len(block_ids) == len(self.kv)
        t0 = time.perf_counter()
        for block_id, kv in zip(block_ids, self.kv):
            self.tiers.io.write_blocks([block_id], kv)
        self.tiers.loaded(len(block_ids), sum(k.numel() * k.element_size() for k in self.kv),
                          time.perf_counter() - t0 + self.verify_s)


class KVTiers:
    """The engine's side of the lower tiers: eviction out, admission in, parking on disk reads."""

    EMA = 0.2  # weight of the newest measurement in the load / prefill cost averages
    PROBE_EVERY = 16  # while recompute is cheaper, every 16th match loads anyway (re-measures the load)

    def __init__(self, store: TierStore, io: BlockIO, block_size: int, load_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, events: BlockEventLog | None = None,
                 watch_interval_s: float = NODE_FEED_INTERVAL_S) -> None:
        """events: the block event log to report moves below the device in (the block manager's),
        None to report nothing. watch_interval_s: with a shared host tier (``store.shared``), how
        often the node tier's change feed is reported (workers/engine/node_feed.py)."""
        self.store = store
        self.events = events
        self._below: dict[bytes, tuple[int, Tier]] = {}  # digest -> (chain hash, tier reported) below the device
        self.io = io
        self.block_size = block_size
        self.load_timeout_s = load_timeout_s
        self._clock = clock
        self._digests: dict[str, list[bytes]] = {}  # request id -> digests of its full blocks so far
        self._key_digest = KeyDigests()
        # evicted from the device, copied out, not yet stored below: digest -> (kv [L, 2, 1, bs, G, D], chain hash)
        self._pending: dict[bytes, tuple[torch.Tensor, int]] = {}
        self._parked: list[_Parked] = []
        self._load_s_per_block: float | None = None
        self._prefill_s_per_token: float | None = None
        self._load_seconds = 0.0
        self._host_hits = 0
        self._skipped = 0  # matches recomputed by the rule since the last load
        self._bytes_loaded = 0
        # with the node's shared host tier: every block in it is reported as held in host here
        self.node_feed = NodeFeed(store, events, watch_interval_s) if store.shared and events is not None else None

    # -------------------------------------------------------------- eviction
    def evicted(self, key: tuple, block_id: int, chain_hash: int) -> None:
        """The block manager is about to reuse ``block_id`` (prefix key ``key``, reported as
        ``chain_hash``): keep a copy below."""
        digest = self._key_digest(key)
        if digest not in self._below:
            self._below[digest] = (chain_hash, Tier.DEVICE)  # DEVICE: not reported below yet
        if self.store.where(digest) == "host":  # inclusive: the copy from its last load is still there
            self.store.touch(digest)  # (or another worker of the node put it in the node's shared tier)
            self._sync(digest)
            return
        self._pending[digest] = (self.io.read_blocks([block_id]).to("cpu"), chain_hash)  # stored by ``flush``

    def flush(self) -> None:
        """Store the blocks evicted since the last flush in host (module docstring: eviction)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for digest, (kv, chain_hash) in pending.items():
            if self.store.where(digest) == "host":  # a neighbour put it in the node's tier meanwhile
                self.store.touch(digest)
                self._sync(digest)
            else:
                self.store.put(digest, kv, chain_hash)
        self._report()

    def _report(self) -> None:
        """Turn the store's moves into block events (``_sync`` each digest it names)."""
        for digest, h in self.store.changes():
            if h and digest not in self._below:  # a neighbour's block from the node tier, now on this disk
                self._below[digest] = (h, Tier.DEVICE)  # (DEVICE: not reported below by this worker yet)
            self._sync(digest)

    def _sync(self, digest: bytes) -> None:
        """The digest's chain hash leaves the lower tier it was reported in and is stored in the
        one ``where`` names now (none: it is gone)."""
        got = self._below.get(digest)
        if got is None:
            return
        h, old = got
        where = self.store.where(digest)
        new = Tier.HOST if where == "host" else Tier.DISK if where == "disk" else None
        if new == old:
            return
        if self.events is not None:
            if new is not None:
                self.events.stored((h,), new)
                if new == Tier.HOST and self.node_feed is not None:
                    # the node tier's feed clears this claim when the file goes, seen by a pass or not
                    # (one bit per tier and hash: the feed's removal is also this claim's)
                    self.store.claim_shared(digest, h)
            if old != Tier.DEVICE:
                self.events.removed((h,), old)
        if new is None:
            del self._below[digest]
        else:
            self._below[digest] = (h, new)

    # ------------------------------------------------------------- admission
    def digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The digests of ``seq``'s first ``num_blocks`` full blocks (cached per request)."""
        got = self._digests.setdefault(seq.request_id, [])
        bs = self.block_size
        while len(got) < num_blocks:
            i = len(got)
            got.append(next_digest(got[-1] if got else root_digest(root_key(seq.adapter)),
                                   seq.token_ids[i * bs:(i + 1) * bs]))
        return got[:num_blocks]

    def recompute_is_cheaper(self) -> bool:
        """The rule in the module docstring: load unless both costs are measured and loading is slower."""
        load, prefill = self._load_s_per_block, self._prefill_s_per_token
        return load is not None and prefill is not None and load > prefill * self.block_size

    def match(self, seq: Sequence, first_block: int, max_blocks: int) -> PrefixLoad | None:
        """Blocks first_block.. of ``seq``'s prefix that host holds (at most ``max_blocks``),
        verified; None when there are none or recompute is cheaper."""
        if max_blocks <= 0:
            return None
        self.flush()  # blocks evicted earlier in this step count as held below
        if self.recompute_is_cheaper():
            self._skipped += 1
            if self._skipped % self.PROBE_EVERY:
                return None
        t0 = time.perf_counter()
        load = PrefixLoad(self)
        for digest in self.digests(seq, first_block + max_blocks)[first_block:]:
            if self.store.where(digest) != "host":
                self.store.prefetch(digest)  # from disk for next time (no-op if absent)
                self._sync(digest)  # reported in host but gone (another worker evicted it from the node's tier)
                break
            kv = self.store.get(digest)
            if kv is None:  # refused (counted by the store): recompute from here
                break
            load.kv.append(kv)
        load.verify_s = time.perf_counter() - t0
        self._report()  # refusals
        return load if load.kv else None

    def read_prefix(self, token_ids: list[int], adapter: str, first_block: int,
                    num_blocks: int) -> list[torch.Tensor | concurrent.futures.Future] | None:
        """For a peer's prefix pull (workers/handoff/prefix_pull.py): blocks first_block ..
        first_block + num_blocks - 1 of ``token_ids``' prefix computed under ``adapter``, from the
        lower tiers: per block its kv from host ([L, 2, 1, bs, G, D], verified now) or, for one on
        disk, a Future of its read (a verified TierBlock, or BlockRefused) that leaves host as it
        is (a peer's pull does not displace this worker's own blocks). None when a block is in no
        tier or host refused it (counted, dropped). Never waits on disk."""
        self.flush()
        bs = self.block_size
        digest = root_digest(root_key(adapter))
        out: list[torch.Tensor | concurrent.futures.Future] = []
        for i in range(first_block + num_blocks):
            digest = next_digest(digest, token_ids[i * bs:(i + 1) * bs])
            if i < first_block:
                continue
            where = self.store.where(digest)
            got = (self.store.get(digest) if where == "host"
                   else self.store.read_disk(digest) if where == "disk" else None)
            if got is None:  # absent, or refused (counted by the store): the peer recomputes
                self._report()
                return None
            out.append(got)
        return out

    def loaded(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self._load_seconds += seconds
        self._host_hits += num_blocks
        self._bytes_loaded += num_bytes
        per_block = seconds / num_blocks
        old = self._load_s_per_block
        self._load_s_per_block = per_block if old is None else old + self.EMA * (per_block - old)

    def observe_prefill(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step computed ``num_prefill_tokens`` prompt tokens in ``seconds`` (an upper bound of
        their share: the step's decodes ran too)."""
        if num_prefill_tokens >= self.block_size:
            per_token = seconds / num_prefill_tokens
            old = self._prefill_s_per_token
            self._prefill_s_per_token = per_token if old is None else old + self.EMA * (per_token - old)

    # --------------------------------------------------------------- parking
    def prefetch(self, seq: Sequence) -> bool:
        """Start disk reads for the prefix blocks of a new request; True: park it (``take_ready``)."""
        self.flush()
        bs = self.block_size
        waiting = []
        for digest in self.digests(seq, (seq.num_tokens - 1) // bs):
            where = self.store.where(digest)
            if where is None:
                break
            if where == "disk" and self.store.prefetch(digest):
                waiting.append(digest)
        if waiting:
            self._parked.append(_Parked(seq, waiting, self._clock() + self.load_timeout_s))
        return bool(waiting)

    def take_ready(self) -> list[Sequence]:
        """Parked requests whose disk reads finished (or timed out: they recompute), oldest first.
        Called every step: finished reads move into host also when nobody is parked (reads started
        by ``match`` for a resuming request); the previous step's evictions are stored first."""
        self.flush()
        self.store.poll()
        self._report()
        if not self._parked:
            return []
        now = self._clock()
        ready, keep = [], []
        for p in self._parked:
            p.digests = [d for d in p.digests if self.store.prefetch(d)]
            if not p.digests:
                ready.append(p.seq)
            elif now >= p.deadline:
                self.store.count_deadline_miss()
                logger.warning("request %s: %d disk KV reads missed the %.3fs deadline; recomputing",
                               p.seq.request_id, len(p.digests), self.load_timeout_s)
                ready.append(p.seq)
            else:
                keep.append(p)
        self._parked = keep
        return ready

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_pending(self) -> int:
        """Evicted blocks not stored below yet: the next step (``take_ready``) stores them."""
        return len(self._pending)

    def wait(self, timeout: float) -> None:
        self.store.wait(timeout)

    def release(self, request_id: str) -> None:
        """A request ended: forget its digests (and its parking, if it was aborted parked)."""
        self._digests.pop(request_id, None)
        self._parked = [p for p in self._parked if p.seq.request_id != request_id]

    def stats(self) -> TierStats:
        return replace(self.store.stats(), host_hits=self._host_hits, bytes_loaded=self._bytes_loaded,
                       load_seconds=self._load_seconds)

    def close(self) -> None:
        self._pending.clear()  # (never reported below)
        if self.node_feed is not None:
            self.node_feed.close()
            self.node_feed = None
        self.store.close()
        if self.events is not None:
            for h, tier in self._below.values():
                if tier != Tier.DEVICE:
                    self.events.removed((h,), tier)
        self._below.clear()
