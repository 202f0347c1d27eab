"""The node's shared host tier (workers/kv/tiers/node.py) without an engine: two workers of one node
share one copy, a worker killed mid-run leaves its blocks to the one that replaces it, a corrupt or
foreign block is refused, the budget holds node-wide (least recently used out), and the last user
out removes the directory: no shared-memory file is left."""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workers.config import CacheConfig, EngineConfig
from workers.engine.kv_tiers import ROOT_DIGEST, next_digest
from workers.engine.runner import KVLayout
from workers.errors import ConfigError
from workers.kv.tiers.block_file import BlockRefused, seal
from workers.kv.tiers.node import PREFIX, NodeTier
from workers.kv.tiers.store import TieredStore, make_tier_store

LAYOUT = KVLayout(2, 4, 2, 8, torch.float32)  # 1 KiB a block (float32)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
FP = 0x1234_5678


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 2, 1, 4, 2, 8, generator=g)


def digest(i: int) -> bytes:
    return next_digest(ROOT_DIGEST, [i, i + 1, i + 2, i + 3])


def test_two_workers_share_one_copy_and_the_last_one_out_cleans_up(tmp_path: Path):
    a = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))
    b = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))
    assert a.dir == b.dir
    a.put(seal(digest(0), block(0)))
    assert digest(0) in b
    got = b.get(digest(0))
    assert got is not None and torch.equal(got.kv, block(0))
    assert len(list(a.dir.glob("*.kvb"))) == 1  # one copy on the node
    a.clear()
    assert a.dir.is_dir() and b.get(digest(0)) is not None  # b still uses it
    b.clear()
    assert list(tmp_path.iterdir()) == []


def test_another_model_uses_another_directory_and_a_foreign_block_is_refused(tmp_path: Path):
    a = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))
    other = NodeTier(1 << 20, FP + 1, LAYOUT, str(tmp_path))
    a.put(seal(digest(0), block(0)))
    assert other.dir != a.dir and digest(0) not in other
    # a file of model FP planted under the other model's name: refused as foreign, deleted
    os.link(a.path(digest(0)), other.path(digest(0)))
    with pytest.raises(BlockRefused) as e:
        other.get(digest(0))
    assert e.value.kind == "foreign" and digest(0) not in other and digest(0) in a
    a.clear()
    other.clear()
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_block_is_refused_counted_and_recomputed(tmp_path: Path):
    store = TieredStore(NodeTier(1 << 20, FP, LAYOUT, str(tmp_path)))
    store.put(digest(0), block(0))
    path = store.host.path(digest(0))  # type: ignore[union-attr]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.where(digest(0)) == "host"
    assert store.get(digest(0)) is None  # refused, never served
    assert store.stats().refused_corrupt == 1 and store.where(digest(0)) is None
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_the_change_feed_names_every_workers_blocks_by_chain_hash_and_their_removal(tmp_path: Path):
    a = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))
    a.put(seal(digest(0), block(0), chain_hash=100))
    b = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))  # starts after a's block: its first pass names it
    assert b.watch() == ([100], [])
    assert b.watch() == ([], [])  # diffs, not the state again
    a.put(seal(digest(1), block(1), chain_hash=(1 << 64) - 5))  # a hash above 2^63 survives the header
    a.put(seal(digest(2), block(2)))  # unknown hash (0): kept and served, not reported
    assert b.watch() == ([(1 << 64) - 5], [])
    got = b.get(digest(1))
    assert got is not None and got.chain_hash == (1 << 64) - 5 and torch.equal(got.kv, block(1))
    a.drop(digest(0))
    a.drop(digest(2))
    assert b.watch() == ([], [100])
    a.clear()
    b.clear()
    assert list(tmp_path.iterdir()) == []


def test_node_budget_evicts_least_recently_used_and_spills_to_disk(tmp_path: Path):
    from workers.kv.tiers.disk import DiskTier

    node = NodeTier(4 * BLOCK_BYTES, FP, LAYOUT, str(tmp_path / "shm"))
    other = NodeTier(4 * BLOCK_BYTES, FP, LAYOUT, str(tmp_path / "shm"))
    store = TieredStore(node, DiskTier(1 << 20, FP, LAYOUT, str(tmp_path / "disk")))
    for i in range(4):
        store.put(digest(i), block(i))
        os.utime(node.path(digest(i)), (1000 + i, 1000 + i))  # a clear LRU order (mtime resolution)
    other.touch(digest(0))  # used by another worker: the most recent now
    store.put(digest(4), block(4))  # 5 KiB > 4 KiB: down to 90% = 3 blocks, oldest first
    assert [digest(i) in node for i in range(5)] == [True, False, False, True, True]
    assert store.where(digest(1)) == "disk" and store.where(digest(2)) == "disk"  # spilled, not lost
    assert node.bytes == 3 * BLOCK_BYTES and len(node) == 3
    store.close()
    other.clear()
    assert list((tmp_path / "shm").iterdir()) == [] and list((tmp_path / "disk").iterdir()) == []


def _held(directory: Path) -> int:
    """Blocks in the node tier's directory, kept or being written (its budget's unit), counted
    under the budget's lock (no eviction or reservation moves meanwhile) by digest (a block renamed
    from its temporary name during the listing may show under both)."""
    fd = os.open(directory / "budget", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return len({p.name.split(".")[0] for p in directory.iterdir() if p.suffix in (".kvb", ".tmp")})
    finally:
        os.close(fd)


def test_node_budget_holds_across_workers_writing_in_turn(tmp_path: Path):
    """Each worker used to count only its own writes since its last look: a second worker writing
    into a full tier kept writing past the budget. Now every write reserves in the node-wide count."""
    a = NodeTier(4 * BLOCK_BYTES, FP, LAYOUT, str(tmp_path))
    b = NodeTier(4 * BLOCK_BYTES, FP, LAYOUT, str(tmp_path))
    for i in range(12):
        (a if i % 3 else b).put(seal(digest(i), block(i)))
        assert _held(a.dir) <= 4  # the old accounting: 4 of a's, then b's on top of them
        assert len(a if i % 3 else b) == _held(a.dir)  # the writer's view of the node-wide count is exact
    assert max(len(a), len(b)) == _held(a.dir) <= 4
    assert digest(11) in a and digest(10) in b  # the newest stay, whoever wrote them
    b.drop(digest(11))  # a refused block leaves the count too
    assert len(b) == _held(a.dir)
    a.clear()
    b.clear()
    assert list(tmp_path.iterdir()) == []


WRITER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from workers.engine.kv_tiers import ROOT_DIGEST, next_digest
    from workers.engine.runner import KVLayout
    from workers.kv.tiers.block_file import seal
    from workers.kv.tiers.node import NodeTier
    root, fp, first, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    tier = NodeTier(8 * 1024, fp, KVLayout(2, 4, 2, 8, torch.float32), root)  # 8 blocks
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    for i in range(first, first + 60):
        g = torch.Generator().manual_seed(i)
        tier.put(seal(next_digest(ROOT_DIGEST, [i, i + 1, i + 2, i + 3]), torch.randn(2, 2, 1, 4, 2, 8, generator=g)))
    print(len(tier), flush=True)
    sys.stdin.readline()  # stay a user of the tier until the test has looked
""")


def test_node_budget_holds_with_two_writer_processes(tmp_path: Path):
    """Two worker processes write 60 blocks each at once into an 8-block node tier: sampled
    throughout, the directory never holds (or is writing) more than 8 blocks, and the shared count
    ends equal to what the directory holds."""
    env = dict(os.environ, PYTHONPATH=str(Path.cwd()) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    go, root = tmp_path / "go", tmp_path / "shm"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(FP), str(first), str(go)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for first in (0, 1000)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        (directory,) = root.glob(f"{PREFIX}*")
        counts: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each writer's last line: its count
            done = [pool.submit(p.stdout.readline) for p in procs if p.stdout is not None]
            go.touch()
            most = samples = 0
            while not all(f.done() for f in done):
                try:
                    most = max(most, _held(directory))
                except FileNotFoundError:  # a file renamed or deleted while listed
                    continue
                samples += 1
            counts = [int(f.result()) for f in done]
        assert samples > 10 and 0 < most <= 8, (samples, most)
        assert _held(directory) <= 8 and all(0 < n <= 8 for n in counts)
        assert int.from_bytes((directory / "budget").read_bytes(), "little") == _held(directory)
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=30)
    assert list(root.iterdir()) == []


WORKER = textwrap.dedent("""
    import sys, time, torch
    from workers.engine.kv_tiers import ROOT_DIGEST, next_digest
    from workers.engine.runner import KVLayout
    from workers.kv.tiers.block_file import seal
    from workers.kv.tiers.node import NodeTier
    tier = NodeTier(1 << 20, int(sys.argv[2]), KVLayout(2, 4, 2, 8, torch.float32), sys.argv[1])
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        tier.put(seal(next_digest(ROOT_DIGEST, [i, i + 1, i + 2, i + 3]), torch.randn(2, 2, 1, 4, 2, 8, generator=g)))
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_killed_worker_leaves_its_blocks_to_its_replacement(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(Path.cwd()) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(FP)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: no close, no finalizer
        proc.wait(timeout=30)
    (directory,) = tmp_path.iterdir()
    assert directory.name.startswith(PREFIX) and len(list((directory / "users").iterdir())) == 1  # the dead user
    restarted = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))  # the replacement on the same node
    assert [p.name.split("-")[0] for p in (directory / "users").iterdir()] == [str(os.getpid())]
    for i in range(3):
        got = restarted.get(digest(i))
        assert got is not None and torch.equal(got.kv, block(i))  # reused, verified
    restarted.clear()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_whose_users_all_died_is_removed_by_the_next_start(tmp_path: Path):
    dead = tmp_path / f"{PREFIX}00000000deadbeef-2-4-2-8-0"
    (dead / "users").mkdir(parents=True)
    (dead / "users" / "999999999-abcd").touch()  # no such pid
    (dead / "x.kvb").write_bytes(b"old")
    tier = NodeTier(1 << 20, FP, LAYOUT, str(tmp_path))
    assert not dead.exists()
    tier.clear()
    assert list(tmp_path.iterdir()) == []


def test_default_root_is_dev_shm_and_nothing_is_leaked():
    fp = int.from_bytes(os.urandom(7), "little")  # this test's own directory
    tier = NodeTier(1 << 20, fp, LAYOUT)
    assert tier.dir.parent == Path("/dev/shm") and tier.dir.is_dir()
    tier.put(seal(digest(0), block(0)))
    tier.clear()
    assert not tier.dir.exists() and not list(Path("/dev/shm").glob(f"{PREFIX}{fp:016x}*"))


def test_config_shared_host_tier():
    cache = CacheConfig(host_tier_bytes=1 << 20, host_tier_shared=True)
    with pytest.raises(ConfigError, match="cache.host_tier_shared=true with cache.host_tier_bytes=0"):
        CacheConfig(host_tier_shared=True, host_tier_bytes=0)
    CacheConfig(host_tier_shared=True)  # auto: the node's budget resolved where the worker runs
    with pytest.raises(ConfigError, match="cache.host_tier_shared=true with device='cuda'"):
        EngineConfig(model="m", device="cuda", cache=cache)
    with pytest.raises(ConfigError, match="cache.host_tier_shared=true on a GPU worker"):
        make_tier_store(cache, LAYOUT, FP, pin=True, device_blocks=8)
    store = make_tier_store(cache, LAYOUT, int.from_bytes(os.urandom(7), "little"), pin=False, device_blocks=8)
    assert store is not None and isinstance(store.host, NodeTier)
    store.close()
    assert not store.host.dir.exists()


def test_config_host_tier_dir(tmp_path):
    """cache.host_tier_dir: where the node tier lives (absolute); the store builds it there."""
    with pytest.raises(ConfigError, match="cache.host_tier_dir='shm': must be an absolute path"):
        CacheConfig(host_tier_bytes=1 << 20, host_tier_shared=True, host_tier_dir="shm")
    cache = CacheConfig(host_tier_bytes=1 << 20, host_tier_shared=True, host_tier_dir=str(tmp_path))
    store = make_tier_store(cache, LAYOUT, FP, pin=False, device_blocks=8)
    assert store is not None and isinstance(store.host, NodeTier) and store.host.dir.parent == tmp_path
    store.close()
    assert list(tmp_path.iterdir()) == []
