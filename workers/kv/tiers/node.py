"""NodeTier: a CPU worker's host KV tier in shared memory, one copy per node, shared by the node's
workers and surviving a worker's restart.

Where the blocks live: files in a tmpfs directory (``/dev/shm``: the node's shared memory), one per
block, named by the block's digest (workers/engine/kv_tiers.py: XXH3-128 of the whole prefix) in a
directory named by the model fingerprint and KV layout:

    <root>/duet-kv-node-<fingerprint>-<layout>/
        <digest>.kvb          a block as block_file.py encodes it: header (magic, fingerprint,
                              layout, digest, checksum, size) + payload; written to a temporary
                              name and renamed, so a reader never sees half a block
        users/<pid>-<token>   one per process using the tier (its liveness: the pid)

Every worker of the node serving the same model (same fingerprint and layout) opens the same
directory: a block one worker evicted is a host hit for every other, and for the worker that
replaces it after a crash (Ray restarts the actor; the files outlive the process). Reads decode
and verify the whole header and checksum (block_file.py ``decode``): a corrupt block or another
model's is refused, deleted and recomputed, never served, as in the per-worker tiers.

Budget and eviction: ``capacity_bytes`` bounds the directory's payload bytes node-wide. A process
counts what it wrote since its last look; past the budget it lists the directory and deletes the
least recently used blocks (file modification time: set by the write, refreshed by every hit) down
to 90% of the budget. Several processes may evict at once: a block deleted under a reader is a
miss (an open file still reads whole), never a torn read.

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
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workers.engine.runner import KVLayout
from workers.kv.tiers.block_file import HEADER_WORDS, BlockRefused, TierBlock, decode, read, read_chain_hash, write

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
        self.bytes = 0  # the directory's payload bytes at the last scan, plus what this process wrote since
        self._blocks = 0
        self._seen: dict[str, int] = {}  # file name -> chain hash (0: unknown) at the last ``watch``
        _join(self.root, self.dir, self._user)
        self._scan()
        # the user file goes (and the directory with the last user) even if close() is never called
        self._finalizer = weakref.finalize(self, _leave, self.root, self.dir, self._user)

    def path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}.kvb"

    def __contains__(self, digest: bytes) -> bool:
        return self.path(digest).exists()

    def __len__(self) -> int:
        return self._blocks

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Keep ``block`` (most recently used); -> the blocks evicted to stay in budget (any worker's:
        the store spills them to its disk tier)."""
        path = self.path(block.digest)
        if path.exists():
            self.touch(block.digest)
            return []
        tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as f:
                write(f, block, self.fingerprint, self.layout)
            os.replace(tmp, path)
        except OSError as e:  # tmpfs full: the block is not kept (recomputed if needed)
            tmp.unlink(missing_ok=True)
            logger.warning("KV node tier: writing %s failed (%s); the block is dropped", path, e)
            return []
        self.bytes += block.nbytes
        self._blocks += 1
        return self._evict() if self.bytes > self.capacity_bytes else []

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
        self.path(digest).unlink(missing_ok=True)

    def clear(self) -> None:
        """Leave the tier (the blocks stay for the node's other workers, or go with the last one)."""
        self._finalizer()

    def watch(self) -> tuple[list[int], list[int]]:
        """(added, removed): the chain hashes of the blocks that appeared in and disappeared from the
        directory since the last call, by any worker of the node (the first call: every block).
        Blocks of unknown hash (0) are not named. Safe beside the engine thread: it touches only
        ``_seen`` (one caller at a time)."""
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

    def _scan(self) -> list[tuple[float, Path, int]]:
        """(mtime, path, payload bytes) of every block, oldest first; refreshes ``bytes``."""
        entries = []
        for e in os.scandir(self.dir):
            if e.name.endswith(".kvb"):
                try:
                    st = e.stat()
                except FileNotFoundError:  # deleted by another worker meanwhile
                    continue
                entries.append((st.st_mtime, Path(e.path), st.st_size - HEADER_WORDS * 8))
        entries.sort()
        self.bytes = sum(n for _, _, n in entries)
        self._blocks = len(entries)
        return entries

    def _evict(self) -> list[TierBlock]:
        out: list[TierBlock] = []
        entries = self._scan()
        for _, path, n in entries:
            if self.bytes <= EVICT_TO * self.capacity_bytes or len(entries) - len(out) <= 1:
                break
            digest = bytes.fromhex(path.stem)
            try:
                raw = read(path)
                out.append(decode(raw, digest, self.fingerprint, self.layout))
            except (FileNotFoundError, BlockRefused):
                pass  # gone already, or not worth keeping below
            path.unlink(missing_ok=True)
            self.bytes -= n
            self._blocks -= 1
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
        for stale in directory.glob("*.tmp"):  # <digest>.<pid>.<token>.tmp half-written by a process that died
            if not _alive(stale.name.split(".")[1]):
                stale.unlink(missing_ok=True)
    logger.info("KV node tier: %s %s", "joined" if reused else "created", directory)


def _leave(root: Path, directory: Path, user: Path) -> None:
    try:
        with _root_lock(root):
            user.unlink(missing_ok=True)
            if directory.is_dir() and not _live_users(directory):
                shutil.rmtree(directory, ignore_errors=True)
                logger.info("KV node tier: removed %s (last user left)", directory)
    except OSError as e:  # the root is gone (a test's temp directory): nothing left to clean
        logger.debug("KV node tier: leaving %s: %s", directory, e)
