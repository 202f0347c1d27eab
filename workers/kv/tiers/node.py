"""NodeTier: a CPU worker's host KV tier in shared memory, one copy per node, shared by the node's
workers and surviving a worker's restart.

Where the blocks live: files in a tmpfs directory (``/dev/shm``: the node's shared memory), one per
block, named by the block's digest (workers/engine/kv_tiers.py: XXH3-128 of the whole prefix) in a
directory named by the model fingerprint and KV layout:

    <root>/duet-kv-node-<fingerprint>-<layout>/
        <digest>.kvb          a block as block_file.py encodes it: header (magic, fingerprint,
                              layout, digest, checksum, size) + payload; written to a temporary
                              name and renamed, so a reader never sees half a block
        budget                the node-wide block count (see Budget), and the lock guarding it
        users/<pid>-<token>   one per process using the tier (its liveness: the pid)

Every worker of the node serving the same model (same fingerprint and layout) opens the same
directory: a block one worker evicted is a host hit for every other, and for the worker that
replaces it after a crash (Ray restarts the actor; the files outlive the process). Reads decode
and verify the whole header and checksum (block_file.py ``decode``): a corrupt block or another
model's is refused, deleted and recomputed, never served, as in the per-worker tiers.

Budget and eviction: ``capacity_bytes`` bounds the directory's blocks node-wide, across every
worker writing to it (all blocks of one directory have one size: its layout's). The directory
keeps an accounting file, ``budget``: the number of blocks it holds or that are being written (an
int64), read and changed only under an exclusive ``flock`` of that file. A ``put`` reserves its
block under the lock before writing it; when the reservation would pass the budget, the same lock
holder lists the directory, resets the count from what it finds (block files plus live writers'
temporary files: a worker that crashed mid-write or a count that drifted is corrected on every
pass) and evicts the least recently used blocks (file modification time: set by the write,
refreshed by every hit) down to 90% of the budget. So the budget holds at every moment, whatever
the number of writers, at the cost of one lock and an 8-byte read and write per block written
(a listing only per eviction pass). Victims are renamed to a private name under the lock and read
(to spill them to the evicting worker's disk tier) and deleted after it. A block deleted or
evicted under a reader is a miss (an open file still reads whole), never a torn read. Workers
configured with different budgets for one directory each enforce their own on their writes.

Change feed: ``watch`` lists the directory and returns the chain hashes (workers/block_hash.py, in
each file's header) of the blocks added and removed since its last call, whoever wrote or deleted
them; its first call lists every block. The engine (workers/engine/node_feed.py) calls it every
second on a thread of its own and reports the diff as host-tier block events, so
every worker of the node reports the node tier's holdings (a restarted worker's first report
included) and a block a neighbour deleted stops being reported within one interval. Only new
names are opened (one header read each): a pass costs one directory listing.

Users and cleanup: joining and leaving take an exclusive ``flock`` on the root directory. Joining
writes this process's user file, drops the user files of dead pids and removes other
``duet-kv-node-*`` directories whose users are all dead (a node whose workers all crashed leaks
nothing past the next start); leaving removes its user file and, when no live user is left, the
whole directory. A crash leaves the directory to the restarted worker (that is the survival).

Example::

    a = NodeTier(1 << 30, fingerprint, layout)       # worker A
    b = NodeTier(1 << 30, fingerprint, layout)       # worker B on the same node
    a.put(block)
    b.get(block.digest)                              # the same block, verified
    a.close(); b.close()                             # the last one out removes the directory

Not thread-safe per instance: the engine thread owns it (as HostTier).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from workers.engine.runner import KVLayout
from workers.kv.tiers.block_file import (HEADER_WORDS, BlockRefused, TierBlock, block_shape, decode, read,
                                         read_chain_hash, write)

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
PREFIX = "duet-kv-node-"
EVICT_TO = 0.9  # an eviction pass frees down to this fraction of the budget (fewer directory scans)


class NodeTier:
    def __init__(self, capacity_bytes: int, fingerprint: int, layout: KVLayout, root: str | None = None) -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.layout = layout
        self.pin = False
        self.root = Path(root or DEFAULT_ROOT)
        layout_tag = "-".join(str(w) for w in layout.as_words())
        self.dir = self.root / f"{PREFIX}{fingerprint & (2**64 - 1):016x}-{layout_tag}"
        self._user = self.dir / "users" / f"{os.getpid()}-{secrets.token_hex(4)}"
        self.block_bytes = torch.Size(block_shape(layout)).numel() * torch.empty((), dtype=layout.dtype).element_size()
        self.capacity_blocks = max(1, capacity_bytes // self.block_bytes)
        self._blocks = 0  # the node-wide count as this process last saw it (under the lock)
        self.bytes = 0  # the same in payload bytes (held or being written)
        self._seen: dict[str, int] = {}  # file name -> chain hash (0: unknown) at the last ``watch``
        self._claimed: dict[str, int] = {}  # ``claim``ed since the last ``watch`` (engine thread -> feed's)
        self._claim_lock = threading.Lock()
        _join(self.root, self.dir, self._user)
        self._budget = os.open(self.dir / "budget", os.O_RDWR | os.O_CREAT, 0o644)
        # the user file goes (and the directory with the last user) even if close() is never called
        self._finalizer = weakref.finalize(self, _leave, self.root, self.dir, self._user, self._budget)
        with self._locked():
            self._set_count(len(self._scan()[0]) + self._scan_writing())  # the truth at join

    def path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}.kvb"

    def __contains__(self, digest: bytes) -> bool:
        return self.path(digest).exists()

    def __len__(self) -> int:
        return self._blocks

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Keep ``block`` (most recently used); -> the blocks evicted to stay in budget (any worker's:
        the store spills them to its disk tier)."""
        assert block.nbytes == self.block_bytes, "a block of this directory's layout"
        path = self.path(block.digest)
        tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with self._locked():  # reserve its place in the node-wide budget (evicting first if full)
            if path.exists():
                victims: list[Path] = []
                reserved = False
            else:
                victims = self._evict() if self._count() + 1 > self.capacity_blocks else []
                tmp.touch()  # a live writer's temporary file: counted by a resync from here on
                self._set_count(self._count() + 1)
                reserved = True
        if not reserved:
            self.touch(block.digest)
            return []
        out = self._take(victims)
        try:
            with open(tmp, "wb") as f:
                write(f, block, self.fingerprint, self.layout)
            with self._locked():  # not while an eviction pass lists the directory: renamed from .tmp to
                os.replace(tmp, path)  # .kvb between its two listings, a block would count in neither
        except OSError as e:  # tmpfs full: the block is not kept (recomputed if needed)
            tmp.unlink(missing_ok=True)
            with self._locked():
                self._set_count(self._count() - 1)
            logger.warning("KV node tier: writing %s failed (%s); the block is dropped", path, e)
        return out

    def get(self, digest: bytes) -> TierBlock | None:
        """The block, verified (None: absent). Raises BlockRefused for a corrupt or foreign block,
        deleted first (the store counts it; the engine recomputes)."""
        path = self.path(digest)
        try:
            raw = read(path)
        except FileNotFoundError:
            return None
        try:
            block = decode(raw, digest, self.fingerprint, self.layout)
        except BlockRefused:
            self.drop(digest)
            raise
        self.touch(digest)
        return block

    def touch(self, digest: bytes) -> None:
        try:
            os.utime(self.path(digest))
        except FileNotFoundError:
            pass

    def drop(self, digest: bytes) -> None:
        with self._locked():
            try:
                self.path(digest).unlink()
            except FileNotFoundError:  # gone already (another worker evicted it): counted there
                return
            self._set_count(self._count() - 1)

    def clear(self) -> None:
        """Leave the tier (the blocks stay for the node's other workers, or go with the last one)."""
        self._finalizer()

    def claim(self, digest: bytes, chain_hash: int) -> None:
        """This worker reported ``digest``'s block in host on its own (its engine put or touched it):
        the next ``watch`` counts the block as seen, so its file's disappearance is reported as a
        removal even when no pass listed the file before it went (otherwise that claim would stand
        for good). Thread-safe."""
        if chain_hash:
            with self._claim_lock:
                self._claimed[self.path(digest).name] = chain_hash

    def watch(self) -> tuple[list[int], list[int]]:
        """(added, removed): the chain hashes of the blocks that appeared in and disappeared from the
        directory since the last call, by any worker of the node (the first call: every block), and
        of ``claim``ed blocks already gone. Blocks of unknown hash (0) are not named. Safe beside the
        engine thread: it touches only ``_seen`` (one caller at a time) and takes the claims under
        their lock."""
        with self._claim_lock:
            claimed, self._claimed = self._claimed, {}
        for name, h in claimed.items():  # claimed before this listing: a file gone by now is a removal
            self._seen[name] = h
        try:
            names = {e.name for e in os.scandir(self.dir) if e.name.endswith(".kvb")}
        except FileNotFoundError:  # the directory went with its last user (this one closing)
            names = set()
        added = []
        for name in names - self._seen.keys():
            try:
                with open(self.dir / name, "rb") as f:
                    h = read_chain_hash(f.read(HEADER_WORDS * 8)) or 0
            except FileNotFoundError:  # deleted meanwhile: not added
                continue
            self._seen[name] = h
            if h:
                added.append(h)
        gone = self._seen.keys() - names
        removed = [h for h in (self._seen.pop(name) for name in gone) if h]
        return added, removed

    # ------------------------------------------------ budget (under the lock)
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The node-wide lock of the directory's budget (an exclusive flock of the budget file)."""
        fcntl.flock(self._budget, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._budget, fcntl.LOCK_UN)

    def _count(self) -> int:
        raw = os.pread(self._budget, 8, 0)
        self._blocks = int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0
        self.bytes = self._blocks * self.block_bytes
        return self._blocks

    def _set_count(self, n: int) -> None:
        self._blocks = max(n, 0)
        self.bytes = self._blocks * self.block_bytes
        os.pwrite(self._budget, self._blocks.to_bytes(8, "little", signed=True), 0)

    def _scan(self) -> tuple[list[tuple[float, Path]], int]:
        """((mtime, path) of every block, oldest first; payload bytes of them)."""
        entries = []
        for e in os.scandir(self.dir):
            if e.name.endswith(".kvb"):
                try:
                    st = e.stat()
                except FileNotFoundError:  # deleted by another worker meanwhile
                    continue
                entries.append((st.st_mtime, Path(e.path)))
        entries.sort()
        return entries, len(entries) * self.block_bytes

    def _scan_writing(self) -> int:
        """Blocks being written by live processes (their temporary files; a dead writer's go)."""
        n = 0
        for e in os.scandir(self.dir):
            if e.name.endswith(".tmp"):
                if _alive(e.name.split(".")[1]):
                    n += 1
                else:
                    Path(e.path).unlink(missing_ok=True)
        return n

    def _evict(self) -> list[Path]:
        """Under the lock: reset the count from the directory and take the least recently used
        blocks out until the next one fits in 90% of the budget; -> the victims, renamed to this
        process's private names (``_take`` reads and deletes them after the lock)."""
        entries, _ = self._scan()
        count = len(entries) + self._scan_writing()
        victims = []
        for _, path in entries:
            if count + 1 <= EVICT_TO * self.capacity_blocks:
                break
            private = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.evict")
            try:
                os.rename(path, private)
            except FileNotFoundError:  # deleted by a worker not holding the lock (cannot happen) or by hand
                pass
            else:
                victims.append(private)
            count -= 1
        self._set_count(count)
        return victims

    def _take(self, victims: list[Path]) -> list[TierBlock]:
        """The evicted blocks, read (for the store to spill to its disk tier) and deleted."""
        out: list[TierBlock] = []
        for path in victims:
            digest = bytes.fromhex(path.name.split(".")[0])
            try:
                out.append(decode(read(path), digest, self.fingerprint, self.layout))
            except (FileNotFoundError, BlockRefused):
                pass  # not worth keeping below
            path.unlink(missing_ok=True)
        return out


@contextmanager
def _root_lock(root: Path) -> Iterator[None]:
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # not ours to judge (another user's process): keep it
    return True


def _live_users(directory: Path) -> list[str]:
    """The user files of live processes; those of dead ones are removed."""
    users = directory / "users"
    live = []
    for name in os.listdir(users) if users.is_dir() else ():
        if _alive(name.split("-", 1)[0]):
            live.append(name)
        else:
            (users / name).unlink(missing_ok=True)
    return live


def _join(root: Path, directory: Path, user: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with _root_lock(root):
        for other in root.glob(f"{PREFIX}*"):
            if other != directory and other.is_dir() and not _live_users(other):
                logger.info("KV node tier: removing %s (no live user left)", other)
                shutil.rmtree(other, ignore_errors=True)
        reused = directory.is_dir()
        (directory / "users").mkdir(parents=True, exist_ok=True)
        _live_users(directory)
        user.touch()
        for stale in [*directory.glob("*.tmp"), *directory.glob("*.evict")]:  # <digest>.<pid>.<token>.tmp
            if not _alive(stale.name.split(".")[1]):  # half-written (or .evict: being evicted) by a dead process
                stale.unlink(missing_ok=True)
    logger.info("KV node tier: %s %s", "joined" if reused else "created", directory)


def _leave(root: Path, directory: Path, user: Path, budget_fd: int) -> None:
    os.close(budget_fd)
    try:
        with _root_lock(root):
            user.unlink(missing_ok=True)
            if directory.is_dir() and not _live_users(directory):
                shutil.rmtree(directory, ignore_errors=True)
                logger.info("KV node tier: removed %s (last user left)", directory)
    except OSError as e:  # the root is gone (a test's temp directory): nothing left to clean
        logger.debug("KV node tier: leaving %s: %s", directory, e)
