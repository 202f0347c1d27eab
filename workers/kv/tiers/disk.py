"""DiskTier: KV blocks as files on local disk under a byte budget, least recently used out first.

Every file operation runs on one background thread (``duet-kv-disk``), in submission order, so
the engine thread never waits on disk: ``put`` queues a write, ``read`` queues a read and returns a
Future, eviction queues a delete. One thread also orders them: a read queued after a write of the
same block finds the file complete (files are written to ``*.tmp`` and renamed).

Files live in a directory of this process's own (``<root>/duet-kv-<pid>-<random>``; root is
``cache.disk_tier_dir`` or the system temp directory); ``close`` deletes it with everything in it,
so a worker leaves no files behind (a crash can: the directory names its pid).

Example::

    disk = DiskTier(1 << 30, fingerprint, layout)
    disk.put(block)                                  # write queued
    fut = disk.read(block.digest)                    # Future -> TierBlock (verified) or BlockRefused
    disk.close()                                     # thread stopped, directory removed
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path

from workers.engine.runner import KVLayout
from workers.kv.tiers.block_file import HEADER_WORDS, BlockRefused, TierBlock, decode, read, write

logger = logging.getLogger(__name__)


class DiskTier:
    def __init__(self, capacity_bytes: int, fingerprint: int, layout: KVLayout, root: str | None = None) -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.layout = layout
        self.bytes = 0
        self.num_errors = 0  # written or read by the disk thread: read on the engine thread (a count)
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"duet-kv-{os.getpid()}-", dir=root))
        self._index: OrderedDict[bytes, int] = OrderedDict()  # digest -> payload bytes, LRU first
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="duet-kv-disk")
        # the directory goes even if close() is never called (interpreter exit)
        self._finalizer = weakref.finalize(self, _remove, self._pool, self.dir)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def __len__(self) -> int:
        return len(self._index)

    def path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}.kvb"

    def put(self, block: TierBlock) -> list[bytes]:
        """Queue a write of ``block``; -> the digests the budget evicted (their deletes queued)."""
        if block.digest in self._index:
            self._index.move_to_end(block.digest)
            return []
        # encoded and written on the disk thread, straight from the tensor: a sealed block's tensor
        # is never written again (the host tier let go of it), so the engine thread copies nothing
        self._index[block.digest] = block.nbytes
        self.bytes += block.nbytes
        self._pool.submit(self._write, self.path(block.digest), block)
        evicted = []
        while self.bytes > self.capacity_bytes and len(self._index) > 1:
            evicted.append(next(iter(self._index)))
            self.drop(evicted[-1])
        return evicted

    def read(self, digest: bytes) -> concurrent.futures.Future:
        """Queue a read; the Future gives the verified TierBlock or raises BlockRefused / OSError."""
        assert digest in self._index
        self._index.move_to_end(digest)
        return self._pool.submit(self._read, self.path(digest), digest)

    def drop(self, digest: bytes) -> None:
        """Forget a block and queue its file's delete."""
        nbytes = self._index.pop(digest, None)
        if nbytes is not None:
            self.bytes -= nbytes
            self._pool.submit(self._delete, self.path(digest))

    def close(self) -> None:
        self._index.clear()
        self.bytes = 0
        self._finalizer()

    # ------------------------------------------------------- disk thread
    def _write(self, path: Path, block: TierBlock) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                write(f, block, self.fingerprint, self.layout)
            os.replace(tmp, path)
        except OSError as e:
            self.num_errors += 1
            logger.warning("KV disk tier: writing %s failed (%s); the block is dropped when read", path, e)

    def _read(self, path: Path, digest: bytes) -> TierBlock:
        try:
            raw = read(path)
        except OSError as e:
            self.num_errors += 1
            raise BlockRefused("corrupt", f"block {digest.hex()}: {e}") from None
        if len(raw) < HEADER_WORDS * 8:
            raise BlockRefused("corrupt", f"block {digest.hex()}: truncated file ({len(raw)} bytes)")
        return decode(raw, digest, self.fingerprint, self.layout)

    @staticmethod
    def _delete(path: Path) -> None:
        path.unlink(missing_ok=True)


def _remove(pool: concurrent.futures.ThreadPoolExecutor, directory: Path) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(directory, ignore_errors=True)
