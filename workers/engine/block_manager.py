"""Paged KV blocks: allocation, reference counts and prefix caching.

The KV cache is one preallocated pool of ``num_blocks`` blocks of ``block_size`` token slots. A
request owns a *block table* (list of block ids, in token order); token ``i`` of the request lives
in slot ``table[i // block_size] * block_size + i % block_size``.

Prefix caching: when a block is full *and computed*, it gets a key
``(parent_key, tuple(its tokens))`` - the chain makes the key identify the whole prefix, not just the
block's own tokens. A new request walks its prompt block by block and takes every block whose key is
cached (ref count + 1) instead of recomputing it. Freed blocks stay cached (ref count 0) in an LRU
free queue and are evicted - their key dropped - only when a new block is needed.

Example (block_size=4): request A = [1 2 3 4 5 6 7 8 9] computes blocks k1=(None,(1,2,3,4)) and
k2=(k1,(5,6,7,8)). Request B = [1 2 3 4 5 6 7 8 0 0] then starts with num_computed_tokens=8 and
two shared blocks; only [0 0] is computed.

Reporting (workers/engine/block_events.py): each key also has a 64-bit chain hash
(workers/block_hash.py) that names the same prefix; every canonical key added to the cache is
recorded as ``stored`` in ``events`` and every one dropped (evicted, reset) as ``removed``, so
routers can read which prefixes this worker holds (router/prefix_index.py).

Sliding windows: when every layer of the model attends only to its last ``window`` keys, the blocks
wholly before a request's window are dead weight. ``release_leading(request_id, n)`` gives the first
``n`` blocks of its table back (they keep their prefix-cache keys, so a later prompt with the same
prefix can still take them until they are evicted) and leaves ``DROPPED_BLOCK`` in their table
entries, so positions keep their block index. Nothing reads or writes a dropped entry: writes go
to the newest tokens, and a windowed attention gathers only the slots of its window
(workers/layers/context_attention.py). Example (block_size=4, window 6): after 13 computed tokens
the next query (position 13) sees keys 8..13, so blocks 0 and 1 (positions 0..7) go back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from workers.block_hash import ROOT, adapter_root, chain_hash
from workers.engine.block_events import BlockEventLog
from workers.engine.sequence import Sequence

logger = logging.getLogger(__name__)

BlockKey = tuple  # (parent BlockKey | root, tuple[int, ...]); root: None (base model) or adapter_root(name)


def root_key(adapter: str) -> int | None:
    """The parent of a prompt's first block key: None for the base model, the adapter's chain root
    (workers/block_hash.py) for a request run under a LoRA adapter, so no key (and no cached block)
    is shared across adapters or with the base model."""
    return adapter_root(adapter) if adapter else None
DROPPED_BLOCK = 0  # table entry of a block released out of the window (never read or written)


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None
    hash: int = 0  # the key's chain hash (workers/block_hash.py), when keyed


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    num_free_blocks: int  # ref count 0, cached or not
    num_cached_blocks: int  # blocks holding a prefix-cache key
    prefix_cache_queries: int  # prompt blocks looked up
    prefix_cache_hits: int  # ... and found

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: BlockEventLog | None = None,
                 on_evict: Callable[[BlockKey, int, int], None] | None = None) -> None:
        """on_evict(key, block_id, chain_hash): called before a prefix-cached block is evicted for
        reuse, while its KV is still intact (the lower KV tiers copy it out and report it under the
        same chain hash: workers/engine/kv_tiers.py)."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first). Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockKey, int] = {}  # key -> block id
        self._tables: dict[str, list[int]] = {}  # request id -> block table
        self._num_hashed: dict[str, int] = {}  # request id -> leading blocks already keyed
        self._last_key: dict[str, BlockKey | int | None] = {}  # request id -> key of its last keyed block
        self._last_hash: dict[str, int] = {}  # request id -> chain hash of its last keyed block
        self.events = events if events is not None else BlockEventLog()  # canonical keys added / dropped
        self._num_dropped: dict[str, int] = {}  # request id -> leading entries released (sliding window)
        self._queries = 0
        self._hits = 0
        self._on_evict = on_evict

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds: its table less the entries released out of the window."""
        return len(self._tables.get(request_id, ())) - self._num_dropped.get(request_id, 0)

    def stats(self) -> BlockStats:
        return BlockStats(self.num_blocks, len(self._free), len(self._cached), self._queries, self._hits)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------- allocation
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the longest cached prefix of ``seq``'s tokens.

        At least one token is always left to compute (the model must produce logits for the last
        prompt token), so a fully cached prompt gives back all but its last block.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        blocks: list[int] = []
        parent: BlockKey | int | None = root_key(seq.adapter)
        for i in range(max_blocks):
            key = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            self._queries += 1
            block_id = self._cached.get(key)
            if block_id is None:
                break
            self._hits += 1
            blocks.append(block_id)
            parent = key
        return blocks

    def cached_prefix(self, token_ids: list[int], adapter: str = "") -> list[int]:
        """The cached blocks spelling the longest cached prefix of ``token_ids`` computed under
        ``adapter`` ("" = the base model) (full blocks only, the last one included; a lookup, not a
        query: the hit counters are left alone)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        blocks: list[int] = []
        parent: BlockKey | int | None = root_key(adapter)
        for i in range(len(token_ids) // bs):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block_id = self._cached.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
            parent = key
        return blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | tuple[int, ...] = ()) -> bool:
        """Make ``seq``'s table cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``cached_blocks`` (from :meth:`match_prefix`, only on first admission) are taken first.
        Returns False, changing nothing, if the pool cannot supply the blocks.
        """
        table = self._tables.get(seq.request_id)
        if table is None:
            table = []
        assert not cached_blocks or not table, "prefix blocks are only taken by a new table"
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(table)
        fresh = need - len(cached_blocks)
        # Cached blocks that are currently free would leave the free queue when taken.
        taken_from_free = sum(1 for b in cached_blocks if self._blocks[b].ref_count == 0)
        if fresh > len(self._free) - taken_from_free:
            return False
        for block_id in cached_blocks:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        for _ in range(max(fresh, 0)):
            table.append(self._pop_free())
        self._tables[seq.request_id] = table
        if cached_blocks:
            self._num_hashed[seq.request_id] = len(cached_blocks)
            self._last_key[seq.request_id] = self._blocks[cached_blocks[-1]].key
            self._last_hash[seq.request_id] = self._blocks[cached_blocks[-1]].hash
        return True

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        assert block.ref_count == 0
        if block.key is not None:  # evict: its content is about to be overwritten
            if self._cached.get(block.key) == block_id:
                if self._on_evict is not None:
                    self._on_evict(block.key, block_id, block.hash)
                del self._cached[block.key]
                self.events.removed((block.hash,))
            block.key = None
        block.ref_count = 1
        return block_id

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Key every block of ``seq`` that is full and computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq.request_id)
        if table is None:
            return
        bs = self.block_size
        done = self._num_hashed.get(seq.request_id, 0)
        # min with num_tokens: verified draft tokens count as computed one commit before they are
        # appended (workers/engine/scheduler.py commit), and a key needs the block's tokens.
        full = min(min(seq.num_computed_tokens, seq.num_tokens) // bs, len(table))
        if full <= done:
            return
        # The parent key is remembered, not read from the block: that block may have been released
        # out of the window, evicted and reused since.
        parent = self._last_key.get(seq.request_id) if done else root_key(seq.adapter)
        parent_hash = self._last_hash.get(seq.request_id, ROOT) if done else adapter_root(seq.adapter)
        added: list[int] = []
        for i in range(done, full):
            block = self._blocks[table[i]]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = (parent, tokens)
            h = chain_hash(parent_hash, tokens)
            if block.key is None:
                block.key, block.hash = key, h
                # A concurrent identical prefix may already be cached under another block; keep
                # the first one as the canonical entry, this block stays private.
                if self._cached.setdefault(key, block.block_id) == block.block_id:
                    added.append(h)
            parent, parent_hash = key, h
        self._num_hashed[seq.request_id] = full
        self._last_key[seq.request_id] = parent
        self._last_hash[seq.request_id] = parent_hash
        if added:
            self.events.stored(added)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Roll a table back to the blocks that ``num_tokens`` tokens need (speculative decoding:
        blocks allocated for draft tokens that were rejected). Returns the blocks freed.

        Only whole trailing blocks go back; slots of rejected tokens inside a kept block are simply
        overwritten by the next tokens. Trailing blocks hold positions >= num_tokens, which are not
        computed, so they never carry a prefix-cache key."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        keep = self.blocks_needed(num_tokens)
        assert keep >= self._num_hashed.get(request_id, 0), "trim below the keyed (computed) prefix"
        freed = 0
        while len(table) > keep:
            block = self._blocks[table.pop()]
            assert block.ref_count == 1 and block.key is None, "a draft block is private and unkeyed"
            block.ref_count = 0
            self._free[block.block_id] = None
            freed += 1
        return freed

    def release_leading(self, request_id: str, num_blocks: int) -> int:
        """Give back the first ``num_blocks`` blocks of a request's table (those wholly before every
        layer's sliding window); their entries become DROPPED_BLOCK. Only full, computed blocks may
        go: with prefix caching they are keyed already (the scheduler keys before it releases).
        Returns the blocks released by this call."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        done = self._num_dropped.get(request_id, 0)
        num_blocks = min(num_blocks, len(table) - 1)  # the newest block is always being written
        if num_blocks <= done:
            return 0
        assert not self.enable_prefix_caching or num_blocks <= self._num_hashed.get(request_id, 0), \
            "release only computed blocks"
        for i in range(done, num_blocks):
            self._unref(table[i])
            table[i] = DROPPED_BLOCK
        self._num_dropped[request_id] = num_blocks
        return num_blocks - done

    def _unref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Tail blocks enter the free queue first, so they are evicted
        before the shared head of the prefix."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._last_key.pop(request_id, None)
        self._last_hash.pop(request_id, None)
        dropped = self._num_dropped.pop(request_id, 0)
        if table is None:
            return
        for block_id in reversed(table[dropped:]):
            self._unref(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached key of free blocks (e.g. after weights change)."""
        for block_id in self._free:
            block = self._blocks[block_id]
            if block.key is not None:
                if self._cached.pop(block.key, None) is not None:
                    self.events.removed((block.hash,))  # the same key has the same hash, whichever block held it
                block.key = None
