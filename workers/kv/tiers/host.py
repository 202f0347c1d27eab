"""HostTier: KV blocks in host memory under a byte budget, least recently used out first.

For a GPU runner the payloads are pinned (page-locked) so a load back to the device is one DMA;
a CPU runner keeps ordinary tensors. ``put`` returns what fell out of the budget (the store spills
it to disk). Not thread-safe: the engine thread owns it.

Example (budget of 2 blocks)::

    host = HostTier(2 * block_bytes)
    host.put(a); host.put(b); host.get(a.digest)     # a is now the most recent
    host.put(c)                                       # -> [b]: b fell out
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from workers.kv.tiers.block_file import TierBlock


class HostTier:
    def __init__(self, capacity_bytes: int, pin: bool = False) -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        self.pin = pin
        self.bytes = 0
        self._blocks: OrderedDict[bytes, TierBlock] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Keep ``block`` (most recently used); -> the blocks evicted to stay in budget (never ``block``
        itself unless one block exceeds the whole budget)."""
        old = self._blocks.pop(block.digest, None)
        if old is not None:
            self.bytes -= old.nbytes
        if self.pin and not block.kv.is_pinned():
            block = replace(block, kv=block.kv.pin_memory())
        self._blocks[block.digest] = block
        self.bytes += block.nbytes
        out = []
        while self.bytes > self.capacity_bytes:
            _, victim = self._blocks.popitem(last=False)
            self.bytes -= victim.nbytes
            out.append(victim)
        return out

    def get(self, digest: bytes) -> TierBlock | None:
        block = self._blocks.get(digest)
        if block is not None:
            self._blocks.move_to_end(digest)
        return block

    def touch(self, digest: bytes) -> None:
        if digest in self._blocks:
            self._blocks.move_to_end(digest)

    def drop(self, digest: bytes) -> None:
        block = self._blocks.pop(digest, None)
        if block is not None:
            self.bytes -= block.nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
