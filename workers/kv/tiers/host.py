"""HostTier: KV blocks in host memory under a byte budget; ``policy`` (workers/kv/tiers/policy.py:
'lru' or 'arc') says which block goes first when it is full.

For a GPU runner the payloads are pinned (page-locked) so a load back to the device is one DMA;
a CPU runner keeps ordinary tensors. ``put`` returns what fell out of the budget (the store spills
it to disk). Not thread-safe: the engine thread owns it.

Example (LRU, budget of 2 blocks)::

    host = HostTier(2 * block_bytes)
    host.put(a); host.put(b); host.get(a.digest)     # a is now the most recent
    host.put(c)                                       # -> [b]: b fell out
"""

from __future__ import annotations

from dataclasses import replace

from workers.kv.tiers.block_file import TierBlock
from workers.kv.tiers.policy import Order, make_order


class HostTier:
    def __init__(self, capacity_bytes: int, pin: bool = False, policy: str = "lru") -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        self.pin = pin
        self.policy = policy
        self.bytes = 0
        self._blocks: dict[bytes, TierBlock] = {}
        self._order: Order | None = None  # made at the first put: ARC counts blocks, known from their size

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Keep ``block`` (as just used); -> the blocks evicted to stay in budget (never ``block``
        itself unless one block exceeds the whole budget)."""
        if self.pin and not block.kv.is_pinned():
            block = replace(block, kv=block.kv.pin_memory())
        if self._order is None:
            self._order = make_order(self.policy, max(1, self.capacity_bytes // max(block.nbytes, 1)))
        order = self._order
        out = []
        old = self._blocks.pop(block.digest, None)
        if old is not None:  # held already: the new copy, in its place
            self.bytes -= old.nbytes
            order.refresh(block.digest)
        else:
            order.prepare(block.digest)
            while self._blocks and self.bytes + block.nbytes > self.capacity_bytes:
                out.append(self._pop(order.evict()))
            order.admit(block.digest)
        self._blocks[block.digest] = block
        self.bytes += block.nbytes
        while self.bytes > self.capacity_bytes:  # one block larger than the budget (or a grown copy)
            out.append(self._pop(order.evict()))
        return out

    def _pop(self, digest) -> TierBlock:
        block = self._blocks.pop(digest)
        self.bytes -= block.nbytes
        return block

    def get(self, digest: bytes) -> TierBlock | None:
        block = self._blocks.get(digest)
        if block is not None and self._order is not None:
            self._order.use(digest)
        return block

    def touch(self, digest: bytes) -> None:
        if digest in self._blocks and self._order is not None:
            self._order.use(digest)

    def drop(self, digest: bytes) -> None:
        block = self._blocks.pop(digest, None)
        if block is not None:
            self.bytes -= block.nbytes
            if self._order is not None:
                self._order.remove(digest)

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
        if self._order is not None:
            self._order.clear()
