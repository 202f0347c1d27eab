"""TieredStore: host memory over local disk, the engine's ``TierStore`` (workers/engine/kv_tiers.py).

A block evicted from the device comes in with ``put``: it is sealed with its checksum (the
fingerprint is the store's) and kept in host; what falls out of host's budget is written to disk
(or dropped without a disk tier); what falls out of disk's budget is deleted. ``get`` serves a
host block after checking its checksum; ``prefetch`` starts a disk read whose result ``poll`` (on
the engine thread) verifies and moves into host. A block that fails a check is refused: dropped
from its tier, counted (``refused_corrupt`` / ``refused_foreign``) and never served; the engine
recomputes it. Every digest whose tiers change (stored, spilled, read back, evicted, refused) is
remembered until ``changes`` hands it over: the engine reports those moves as block events.

Example::

    store = TieredStore(HostTier(64 << 20), DiskTier(1 << 30, fingerprint, layout))
    store.put(digest, kv, chain_hash)       # kv [L, 2, 1, bs, G, D] on the CPU
    store.where(digest)                     # 'host'
    store.get(digest)                       # the tensor, verified
    store.close()
"""

from __future__ import annotations

import concurrent.futures
import logging

import torch

from workers.config import CacheConfig
from workers.errors import ConfigError
from workers.engine.kv_tiers import TierStats
from workers.engine.runner import KVLayout
from workers.kv.tiers.block_file import BlockRefused, TierBlock, block_nbytes, seal, verify
from workers.kv.tiers.budget import host_tier_budget, memory_headroom_bytes
from workers.kv.tiers.disk import DiskTier
from workers.kv.tiers.host import HostTier
from workers.kv.tiers.node import NodeTier

logger = logging.getLogger(__name__)


class TieredStore:
    def __init__(self, host: HostTier | NodeTier, disk: DiskTier | None = None) -> None:
        """host: this process's HostTier, or the node's shared NodeTier (a CPU worker with
        cache.host_tier_shared)."""
        self.host = host
        self.disk = disk
        self.shared = isinstance(host, NodeTier)
        self._reads: dict[bytes, concurrent.futures.Future] = {}
        # digests whose tiers changed since the last ``changes`` -> their chain hash where a block
        # carried one (a block of the node's tier another worker put there), else 0
        self._changed: dict[bytes, int] = {}
        # (host hits and bytes loaded into the device are counted where the load happens: KVTiers)
        self._n = dict(disk_hits=0, stored_blocks=0, bytes_to_host=0, bytes_to_disk=0, host_evictions=0, disk_evictions=0, refused_corrupt=0, refused_foreign=0,
                       deadline_misses=0)

    def put(self, digest: bytes, kv: torch.Tensor, chain_hash: int = 0) -> None:
        block = seal(digest, kv, chain_hash)
        self._n["stored_blocks"] += 1
        self._n["bytes_to_host"] += block.nbytes
        self._changed[digest] = chain_hash
        self._spill(self.host.put(block))

    def _spill(self, victims: list[TierBlock]) -> None:
        """Blocks out of host's budget go to disk (dropped without a disk tier)."""
        for victim in victims:
            self._n["host_evictions"] += 1
            self._changed[victim.digest] = victim.chain_hash
            if self.disk is not None:
                self._n["bytes_to_disk"] += victim.nbytes
                deleted = self.disk.put(victim)
                self._n["disk_evictions"] += len(deleted)
                self._changed.update(dict.fromkeys(deleted, 0))

    def touch(self, digest: bytes) -> None:
        self.host.touch(digest)

    def where(self, digest: bytes) -> str | None:
        if digest in self.host:
            return "host"
        if self.disk is not None and digest in self.disk:
            return "disk"
        return None

    def get(self, digest: bytes) -> torch.Tensor | None:
        try:
            block = self.host.get(digest)  # a NodeTier decodes and verifies the file as it reads it (or refuses)
            if block is None:
                return None
            if not self.shared:  # a HostTier block: its checksum against the memory it sits in
                verify(block)
        except BlockRefused as e:
            self._refuse(e)
            self.host.drop(digest)
            self._changed.setdefault(digest, 0)
            return None
        return block.kv

    def prefetch(self, digest: bytes) -> bool:
        if digest in self._reads:
            return True
        if self.disk is None or digest in self.host or digest not in self.disk:
            return False
        self._reads[digest] = self.disk.read(digest)
        return True

    def read_disk(self, digest: bytes) -> concurrent.futures.Future | None:
        if self.disk is None or digest not in self.disk:
            return None
        return self.disk.read(digest)

    def poll(self) -> None:
        for digest, fut in list(self._reads.items()):
            if not fut.done():
                continue
            del self._reads[digest]
            try:
                block = fut.result()
            except BlockRefused as e:
                self._refuse(e)
                assert self.disk is not None
                self.disk.drop(digest)
                self._changed.setdefault(digest, 0)
                continue
            self._n["disk_hits"] += 1
            self._changed.setdefault(digest, 0)
            self._spill(self.host.put(block))

    def watch_shared(self) -> tuple[list[int], list[int]]:
        """The shared host tier's change feed (NodeTier.watch: chain hashes added, removed); only
        when ``shared``. Called off the engine thread."""
        assert isinstance(self.host, NodeTier)
        return self.host.watch()

    def claim_shared(self, digest: bytes, chain_hash: int) -> None:
        """Only when ``shared``: the engine reported this block in host itself (NodeTier.claim)."""
        assert isinstance(self.host, NodeTier)
        self.host.claim(digest, chain_hash)

    def changes(self) -> list[tuple[bytes, int]]:
        """(digest, chain hash or 0) of each block whose tiers changed since the last call (``where``
        says where it is now)."""
        out = list(self._changed.items())
        self._changed.clear()
        return out

    def wait(self, timeout: float) -> None:
        if self._reads:
            concurrent.futures.wait(list(self._reads.values()), timeout, concurrent.futures.FIRST_COMPLETED)

    def count_deadline_miss(self) -> None:
        self._n["deadline_misses"] += 1

    def _refuse(self, e: BlockRefused) -> None:
        self._n[f"refused_{e.kind}"] += 1
        logger.warning("KV tier block refused (%s), it will be recomputed: %s", e.kind, e)

    def stats(self) -> TierStats:
        d = self.disk
        return TierStats(
            host_capacity_bytes=self.host.capacity_bytes, host_bytes=self.host.bytes, host_blocks=len(self.host),
            disk_capacity_bytes=d.capacity_bytes if d is not None else 0, disk_bytes=d.bytes if d is not None else 0,
            disk_blocks=len(d) if d is not None else 0, disk_errors=d.num_errors if d is not None else 0, **self._n)

    def close(self) -> None:
        for fut in self._reads.values():
            fut.cancel()
        self._reads.clear()
        self._changed.clear()
        self.host.clear()
        if self.disk is not None:
            self.disk.close()


def make_tier_store(cache: CacheConfig, layout: KVLayout, fingerprint: int, pin: bool,
                    device_blocks: int) -> TieredStore | None:
    """The store ``cache`` asks for (None when its host tier resolves to 0: workers/kv/tiers/budget.py).
    pin: page-locked host memory (a GPU runner); device_blocks: the device cache's blocks (the
    'auto' budget's size)."""
    block_bytes = block_nbytes(layout)
    host_bytes = host_tier_budget(cache, device_blocks * block_bytes, block_bytes,
                                  memory_headroom_bytes() if cache.host_tier_bytes == "auto" else 0)
    if host_bytes == 0:
        return None
    if cache.host_tier_shared and pin:
        raise ConfigError("cache.host_tier_shared=true on a GPU worker (device cuda): the node's shared host tier "
                          "is for CPU workers; set device to cpu or host_tier_shared to false")
    host = (NodeTier(host_bytes, fingerprint, layout, root=cache.host_tier_dir) if cache.host_tier_shared
            else HostTier(host_bytes, pin=pin, policy=cache.tier_policy))
    disk = (DiskTier(cache.disk_tier_bytes, fingerprint, layout, cache.disk_tier_dir)
            if cache.disk_tier_bytes else None)
    logger.info("KV tiers: host %d bytes%s%s, disk %s, policy %s", host_bytes,
                " (auto)" if cache.host_tier_bytes == "auto" else "",
                " (pinned)" if pin else f" (shared by the node: {host.dir})" if isinstance(host, NodeTier) else "",
                f"{cache.disk_tier_bytes} bytes in {disk.dir}" if disk else "off", cache.tier_policy)
    return TieredStore(host, disk)
