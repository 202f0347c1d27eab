"""Block events with KV tiers (workers/engine/block_events.py, workers/engine/kv_tiers.py): a block
evicted from the device is reported as moved to host, then to disk, then gone; a refused block is
reported gone; a block loaded back is on the device again; and the index a router builds from those
events predicts exactly what the engine serves (device hits, then host loads)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from router.prefix_index import BlockReport, PrefixIndex
from workers.block_hash import Tier, chain_hashes
from workers.config import SchedulerConfig
from workers.engine.block_events import BlockEventLog
from workers.engine.block_manager import BlockManager
from workers.engine.kv_tiers import KVTiers
from workers.engine.runner import KVLayout
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.kv.tiers.disk import DiskTier
from workers.kv.tiers.host import HostTier
from workers.kv.tiers.store import TieredStore
from workers.sampling_params import SamplingParams

BS = 4
BLOCK_BYTES = 2 * 2 * 1 * BS * 1 * 4 * 4  # [L=2, 2, 1, bs, G=1, D=4] float32
LAYOUT = KVLayout(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=4, dtype=torch.float32)


class TensorPool:
    """A runner's KV block pool and nothing else: [L, 2, num_blocks, bs, G, D] (BlockIO)."""

    def __init__(self, num_blocks: int) -> None:
        self.kv = torch.zeros(2, 2, num_blocks, BS, 1, 4)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv[:, :, block_ids].clone()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        self.kv[:, :, block_ids] = kv


def build(num_blocks: int, store: TieredStore, watch_interval_s: float = 3600.0):
    """watch_interval_s: how often a shared host tier's feed is reported (by default: only at
    construction and by explicit ``node_feed.poll`` calls, so a test decides when)."""
    pool = TensorPool(num_blocks)
    events = BlockEventLog()
    tiers = KVTiers(store, pool, BS, load_timeout_s=5.0, events=events, watch_interval_s=watch_interval_s)
    bm = BlockManager(num_blocks, BS, events=events, on_evict=tiers.evicted)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256), bm, lower_tiers=tiers)
    return pool, tiers, bm, sched


def run_prefill(pool: TensorPool, sched: Scheduler, seq: Sequence) -> int:
    """Schedule ``seq`` alone, 'compute' its KV (slot of token t holds float(t)), free it, start the
    next step (the evicted blocks are stored below); -> the prompt tokens that were not computed
    (device hits + host loads)."""
    sched.add(seq)
    out = sched.schedule()
    (chunk,) = out.chunks
    for i, tok in enumerate(chunk.token_ids):
        pos = chunk.start_pos + i
        pool.kv[:, :, chunk.block_table[pos // BS], pos % BS] = float(tok)
    sched.commit(out)
    sched.remove(seq)
    assert isinstance(sched.lower_tiers, KVTiers)
    sched.lower_tiers.take_ready()  # the engine's next step starts by storing this one's evictions below
    return chunk.start_pos


def held(events: BlockEventLog) -> dict[int, int]:
    diff = events.read(0)
    return BlockReport(diff.seq, diff.snapshot, diff.stored, diff.removed, diff.stored_tiers).held()


def test_log_reports_the_fastest_tier_and_only_its_changes():
    log = BlockEventLog()
    log.stored([1, 2])
    assert log.read(0).stored_tiers == []  # all on the device: no tier list on the wire
    seq = log.seq
    log.stored([1], Tier.HOST)  # a host copy of a device block: still reported on the device
    assert log.seq == seq and log.tier(1) == Tier.DEVICE
    log.removed([1])  # evicted from the device: now in host
    diff = log.read(seq)
    assert (diff.stored, diff.removed, diff.stored_tiers) == ([1], [], [Tier.HOST])
    log.stored([1], Tier.DISK)
    log.removed([1], Tier.HOST)  # spilled
    log.removed([2])
    diff = log.read(diff.seq)
    assert sorted(zip(diff.stored, diff.stored_tiers)) == [(1, Tier.DISK)] and diff.removed == [2]
    snap = log.read(0)
    assert snap.snapshot and list(zip(snap.stored, snap.stored_tiers)) == [(1, Tier.DISK)]
    log.removed([1], Tier.DISK)
    assert log.num_held() == 0 and log.read(diff.seq).removed == [1]


def test_evicted_blocks_are_reported_in_host_then_disk_then_gone(tmp_path: Path):
    store = TieredStore(HostTier(2 * BLOCK_BYTES), DiskTier(3 * BLOCK_BYTES, 7, LAYOUT, str(tmp_path)))
    pool, tiers, bm, sched = build(4, store)
    a = list(range(1, 14))  # 3 full blocks
    run_prefill(pool, sched, Sequence("a", a, SamplingParams(), 0))
    ha = chain_hashes(a, BS)
    assert held(bm.events) == dict.fromkeys(ha, Tier.DEVICE)
    run_prefill(pool, sched, Sequence("b", list(range(100, 116)), SamplingParams(), 1))  # evicts a's 3 blocks
    got = held(bm.events)
    # host holds 2 blocks, the first evicted spilled to disk (a's tail is evicted first: freed first)
    assert sorted(got[h] for h in ha) == [Tier.HOST, Tier.HOST, Tier.DISK], got
    assert tiers.stats().host_blocks == 2 and tiers.stats().disk_blocks == 1
    run_prefill(pool, sched, Sequence("c", list(range(200, 216)), SamplingParams(), 2))  # b's go down too
    got = held(bm.events)
    below = {h: t for h, t in got.items() if t != Tier.DEVICE}
    assert len(below) == 2 + 3  # what host and disk hold, no more: the rest is reported removed
    assert sum(t == Tier.DISK for t in below.values()) == 3 and store.disk is not None and len(store.disk) == 3
    tiers.close()
    assert all(t == Tier.DEVICE for t in held(bm.events).values())  # nothing below the device after close


def test_a_block_loaded_back_is_on_the_device_again():
    store = TieredStore(HostTier(1 << 20))
    pool, tiers, bm, sched = build(4, store)
    a = list(range(1, 13))
    run_prefill(pool, sched, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool, sched, Sequence("b", list(range(100, 116)), SamplingParams(), 1))
    ha = chain_hashes(a, BS)
    assert [held(bm.events)[h] for h in ha] == [Tier.HOST] * 3
    seq = bm.events.seq
    assert run_prefill(pool, sched, Sequence("a2", a + [13], SamplingParams(), 2)) == 12  # 3 blocks loaded
    diff = bm.events.read(seq)
    assert {h: t for h, t in zip(diff.stored, diff.stored_tiers or [Tier.DEVICE] * len(diff.stored))
            if h in ha} == dict.fromkeys(ha, Tier.DEVICE)  # the restore is a block event


def test_a_refused_block_is_reported_gone():
    store = TieredStore(HostTier(1 << 20))
    pool, tiers, bm, sched = build(4, store)
    a = list(range(1, 13))
    run_prefill(pool, sched, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool, sched, Sequence("b", list(range(100, 116)), SamplingParams(), 1))
    first = tiers.digests(Sequence("p", a, SamplingParams(), 9), 1)[0]
    block = store.host.get(first)
    assert block is not None
    block.kv.view(-1)[0] += 1.0  # damage the host copy: its checksum no longer matches
    assert run_prefill(pool, sched, Sequence("a2", a + [13], SamplingParams(), 2)) == 0  # refused: recomputed
    assert store.stats().refused_corrupt == 1
    ha = chain_hashes(a, BS)
    assert held(bm.events)[ha[0]] == Tier.DEVICE  # recomputed into the device, not reported from host


def test_reported_tiers_predict_what_the_engine_serves():
    """Equivalence: for random prompts sharing prefixes, under eviction into a host tier, the index a
    router builds from the events predicts exactly the tokens the engine does not compute (device hits
    then host loads), and no block reported in host comes before one on the device."""
    rng = random.Random(11)
    store = TieredStore(HostTier(10 * BLOCK_BYTES))
    pool, tiers, bm, sched = build(8, store)
    index = PrefixIndex()
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(5)]
    seq = 0
    hosts = 0
    for i in range(80):
        prompt = rng.choice(stems)[: rng.choice([4, 8, 12, 16])] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        diff = bm.events.read(seq)
        index.apply("w", "inc", BlockReport(diff.seq, diff.snapshot, diff.stored, diff.removed, diff.stored_tiers),
                    block_size=BS)
        seq = diff.seq
        tiers_of = index.match_tiers(prompt).get("w", [])
        assert tiers_of == sorted(tiers_of) and Tier.DISK not in tiers_of, tiers_of
        hosts += tiers_of.count(Tier.HOST)
        predicted = min(len(tiers_of), (len(prompt) - 1) // BS) * BS
        assert run_prefill(pool, sched, Sequence(f"r{i}", prompt, SamplingParams(), i)) == predicted, (i, prompt)
    assert hosts > 0 and tiers.stats().host_hits > 0  # the host tier was exercised


def test_a_block_already_in_the_node_tier_is_reported_by_the_worker_that_evicts_it(tmp_path: Path):
    """Two workers of one node share the node's host tier: the second evicts a prefix the first
    already put there (no second copy) and still reports it as held in host."""
    from workers.kv.tiers.node import NodeTier

    stores = [TieredStore(NodeTier(1 << 20, 7, LAYOUT, str(tmp_path))) for _ in range(2)]
    built = [build(4, store) for store in stores]
    a = list(range(1, 13))
    ha = chain_hashes(a, BS)
    for i, (pool, _tiers, bm, sched) in enumerate(built):
        run_prefill(pool, sched, Sequence(f"a{i}", a, SamplingParams(), 0))
        run_prefill(pool, sched, Sequence(f"b{i}", list(range(100, 116)), SamplingParams(), 1))
        assert [held(bm.events)[h] for h in ha] == [Tier.HOST] * 3
    assert len(list(stores[0].host.dir.glob("*.kvb"))) == 3  # a's 3 blocks, once  # type: ignore[union-attr]
    assert stores[0].stats().stored_blocks == 3 and stores[1].stats().stored_blocks == 0  # no second copy
    for _, tiers, _, _ in built:
        tiers.close()
    assert list(tmp_path.iterdir()) == []


def test_a_block_a_neighbour_deleted_from_the_node_tier_is_reported_gone_on_the_next_lookup(tmp_path: Path):
    from workers.kv.tiers.node import NodeTier

    store = TieredStore(NodeTier(1 << 20, 7, LAYOUT, str(tmp_path)))
    pool, tiers, bm, sched = build(4, store)
    a = list(range(1, 13))
    ha = chain_hashes(a, BS)
    run_prefill(pool, sched, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool, sched, Sequence("b", list(range(100, 116)), SamplingParams(), 1))
    assert [held(bm.events)[h] for h in ha] == [Tier.HOST] * 3
    first = tiers.digests(Sequence("p", a, SamplingParams(), 9), 1)[0]
    store.host.path(first).unlink()  # a neighbour's eviction pass  # type: ignore[union-attr]
    assert tiers.match(Sequence("a2", a + [13], SamplingParams(), 2), 0, 3) is None  # the lookup finds it gone
    got = held(bm.events)
    assert ha[0] not in got and [got[h] for h in ha[1:]] == [Tier.HOST] * 2  # no stale host claim left
    tiers.close()


def _index(**workers: BlockEventLog) -> PrefixIndex:
    index = PrefixIndex()
    for wid, events in workers.items():
        diff = events.read(0)
        index.apply(wid, "i", BlockReport(diff.seq, diff.snapshot, diff.stored, diff.removed, diff.stored_tiers),
                    block_size=BS)
    return index


def test_every_worker_of_a_node_reports_the_node_tiers_blocks_and_serves_them(tmp_path: Path):
    """Worker a evicts a prefix into the node tier; worker b (never saw it) and worker c (started
    afterwards: a restart) report it held in host, a router's index matches it on both, and b loads
    exactly what it reported instead of computing it."""
    from workers.kv.tiers.node import NodeTier

    def store() -> TieredStore:
        return TieredStore(NodeTier(1 << 20, 7, LAYOUT, str(tmp_path)))

    pool_a, tiers_a, bm_a, sched_a = build(4, store())
    pool_b, tiers_b, bm_b, sched_b = build(4, store())
    a = list(range(1, 13))
    ha = chain_hashes(a, BS)
    run_prefill(pool_a, sched_a, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool_a, sched_a, Sequence("f", list(range(100, 116)), SamplingParams(), 1))  # a -> node tier
    assert all(h not in held(bm_b.events) for h in ha)  # b has not looked at the feed since
    tiers_b.node_feed.poll()
    assert [held(bm_b.events)[h] for h in ha] == [Tier.HOST] * 3
    _, tiers_c, bm_c, _ = build(4, store())  # a worker started now: its first report names them
    assert [held(bm_c.events)[h] for h in ha] == [Tier.HOST] * 3
    index = _index(b=bm_b.events, c=bm_c.events)
    assert index.match_tiers(a + [13], ["b", "c"]) == {"b": [Tier.HOST] * 3, "c": [Tier.HOST] * 3}
    # b serves what it reports: the 3 blocks are loaded from the node tier, not computed
    assert run_prefill(pool_b, sched_b, Sequence("a2", a + [13], SamplingParams(), 2)) == 12
    assert tiers_b.stats().host_hits == 3 and tiers_b.stats().stored_blocks == 0
    rows = {tuple(pool_b.kv[0, 0, i, :, 0, 0].tolist()) for i in range(4)}  # slot of token t holds float(t)
    assert all(tuple(float(t) for t in a[i * BS:(i + 1) * BS]) in rows for i in range(3))  # a's KV, loaded
    # the feed reports diffs: a second pass with nothing changed reports nothing
    seq = bm_c.events.seq
    tiers_c.node_feed.poll()
    assert bm_c.events.seq == seq
    for t in (tiers_a, tiers_b, tiers_c):
        t.close()
    assert list(tmp_path.iterdir()) == []


def test_a_block_a_neighbour_deleted_from_the_node_tier_is_reported_gone_within_the_interval(tmp_path: Path):
    """Without any lookup: the feed's thread reports the deletion within its interval."""
    import time

    from workers.kv.tiers.node import NodeTier

    store_a = TieredStore(NodeTier(1 << 20, 7, LAYOUT, str(tmp_path)))
    pool_a, tiers_a, bm_a, sched_a = build(4, store_a)
    _, tiers_b, bm_b, _ = build(4, TieredStore(NodeTier(1 << 20, 7, LAYOUT, str(tmp_path))), watch_interval_s=0.05)
    a = list(range(1, 13))
    ha = chain_hashes(a, BS)
    run_prefill(pool_a, sched_a, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool_a, sched_a, Sequence("f", list(range(100, 116)), SamplingParams(), 1))

    def wait_for(cond) -> bool:
        deadline = time.monotonic() + 10.0  # 200 intervals: generous for a loaded CI machine
        while not cond():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    assert wait_for(lambda: all(held(bm_b.events).get(h) == Tier.HOST for h in ha))
    first = tiers_a.digests(Sequence("p", a, SamplingParams(), 9), 1)[0]
    store_a.host.path(first).unlink()  # a neighbour's eviction pass  # type: ignore[union-attr]
    assert wait_for(lambda: ha[0] not in held(bm_b.events))
    assert [held(bm_b.events)[h] for h in ha[1:]] == [Tier.HOST] * 2
    tiers_b.close()
    assert held(bm_b.events) == {}  # b's report of the node tier ends with it
    tiers_a.close()
    assert list(tmp_path.iterdir()) == []


def test_a_block_this_worker_put_in_the_node_tier_and_lost_before_its_feed_looked_is_reported_gone(tmp_path: Path):
    """The worker reports its own evictions into the node tier at once (engine thread); its feed
    lists the directory only every interval. A block deleted in between (a neighbour's eviction
    pass) was never listed, yet its removal must clear the worker's claim: it used to stand for
    good (tests/router/test_node_tier_routing.py's deletion test timed out on it once)."""
    from workers.kv.tiers.node import NodeTier

    store = TieredStore(NodeTier(1 << 20, 7, LAYOUT, str(tmp_path)))
    pool, tiers, bm, sched = build(4, store)  # the feed passes only when the test polls
    a = list(range(1, 13))
    ha = chain_hashes(a, BS)
    run_prefill(pool, sched, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool, sched, Sequence("f", list(range(100, 116)), SamplingParams(), 1))
    assert [held(bm.events).get(h) for h in ha] == [Tier.HOST] * 3  # reported by the engine, not the feed
    for d in tiers.digests(Sequence("p", a, SamplingParams(), 9), 2):  # gone before any pass listed them
        store.host.path(d).unlink()  # type: ignore[union-attr]
    assert tiers.node_feed is not None
    tiers.node_feed.poll()
    assert [held(bm.events).get(h) for h in ha] == [None, None, Tier.HOST]
    tiers.close()
    assert Tier.HOST not in held(bm.events).values() and list(tmp_path.iterdir()) == []


def test_a_neighbours_block_the_node_tier_pushed_onto_this_workers_disk_is_reported_on_disk(tmp_path: Path):
    """The node tier's budget (3 blocks here) is node-wide: worker b's put pushes worker a's blocks
    out, onto b's disk tier. b reports them on disk (their files carry the chain hash), not gone."""
    from workers.kv.tiers.disk import DiskTier
    from workers.kv.tiers.node import NodeTier

    store_a = TieredStore(NodeTier(3 * BLOCK_BYTES, 7, LAYOUT, str(tmp_path / "shm")))
    store_b = TieredStore(NodeTier(3 * BLOCK_BYTES, 7, LAYOUT, str(tmp_path / "shm")),
                          DiskTier(1 << 20, 7, LAYOUT, str(tmp_path / "disk")))
    pool_a, tiers_a, _, sched_a = build(4, store_a)
    pool_b, tiers_b, bm_b, sched_b = build(4, store_b)
    a = list(range(1, 13))
    ha = chain_hashes(a, BS)
    run_prefill(pool_a, sched_a, Sequence("a", a, SamplingParams(), 0))
    run_prefill(pool_a, sched_a, Sequence("f", list(range(100, 116)), SamplingParams(), 1))  # a's 3 blocks -> node
    tiers_b.node_feed.poll()
    assert [held(bm_b.events)[h] for h in ha] == [Tier.HOST] * 3
    b = list(range(200, 216))  # 4 blocks: b's 4th write takes b's count of the node tier past the budget
    run_prefill(pool_b, sched_b, Sequence("b", b, SamplingParams(), 2))
    run_prefill(pool_b, sched_b, Sequence("g", list(range(300, 316)), SamplingParams(), 3))  # b's blocks push a's out
    tiers_b.node_feed.poll()
    got = held(bm_b.events)
    on_disk = [h for h in ha if got.get(h) == Tier.DISK]
    assert on_disk and all(got.get(h) in (Tier.HOST, Tier.DISK) for h in ha)  # moved, none reported lost
    assert len(on_disk) == sum(store_b.where(d) == "disk" for d in tiers_b.digests(Sequence("p", a, SamplingParams(), 9), 3))
    # and b serves what it reports: a's prefix loads (from the node tier and b's disk), nothing computed
    seq = Sequence("a2", a + [13], SamplingParams(), 4)
    assert tiers_b.prefetch(seq)  # parked on its disk reads
    end = time.monotonic() + 10
    while not tiers_b.take_ready():
        assert time.monotonic() < end
        tiers_b.wait(0.05)
    assert run_prefill(pool_b, sched_b, seq) == 12
    for t in (tiers_a, tiers_b):
        t.close()
