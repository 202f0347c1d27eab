"""Block events (workers/engine/block_events.py) and chain hashes (workers/block_hash.py): what a worker
reports holding is exactly what its block manager would reuse, through stores, evictions and resets."""

from __future__ import annotations

import random

from router.prefix_index import BlockReport, PrefixIndex
from workers.block_hash import chain_hashes
from workers.engine.block_events import BlockEventLog
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence
from workers.sampling_params import SamplingParams


def _admit(bm: BlockManager, rid: str, tokens: list[int]) -> int:
    s = Sequence(rid, tokens, SamplingParams(), 0)
    cached = bm.match_prefix(s)
    s.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return len(cached)


def test_log_diff_snapshot_and_forgetting():
    log = BlockEventLog(capacity=3)
    log.stored([11, 12])
    log.removed([11])
    first = log.read(0)
    assert first.snapshot and first.seq == 3 and sorted(first.stored) == [12]
    log.stored([13])
    log.stored([13])  # already held: no event
    diff = log.read(first.seq)
    assert (diff.snapshot, diff.seq, diff.stored, diff.removed) == (False, 4, [13], [])
    log.removed([12])
    log.stored([14, 15])  # 5 hashes touched, capacity 3: cursors before the forgotten ones get a snapshot
    old = log.read(first.seq)
    assert old.snapshot and sorted(old.stored) == [13, 14, 15]
    recent = log.read(log.seq - 1)
    assert not recent.snapshot and recent.stored == [15]
    assert log.read(log.seq + 5).snapshot  # a cursor from the future (another incarnation's)


def test_block_manager_reports_chain_hashes_of_what_it_caches():
    bm = BlockManager(num_blocks=16, block_size=4)
    _admit(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert sorted(bm.events.read(0).stored) == sorted(chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))
    _admit(bm, "b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])  # two blocks shared, one new
    held = set(bm.events.read(0).stored)
    assert held == set(chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4)) | set(chain_hashes([1, 2, 3, 4], 4))


def test_reported_holdings_match_what_the_block_manager_reuses():
    """Equivalence: for random prompts sharing prefixes, under eviction (a small pool), the index built
    from the events predicts exactly the prefix hit ``match_prefix`` finds."""
    rng = random.Random(7)
    bm = BlockManager(num_blocks=12, block_size=4)
    index = PrefixIndex()
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    seq = 0
    for i in range(60):
        prompt = rng.choice(stems)[: rng.choice([4, 8, 12])] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        diff = bm.events.read(seq)
        index.apply("w", "inc", BlockReport(diff.seq, diff.snapshot, diff.stored, diff.removed), block_size=4)
        seq = diff.seq
        predicted = index.match(prompt).get("w", 0)
        probe = Sequence(f"probe{i}", prompt, SamplingParams(), 0)
        # match_prefix leaves the last token to compute: a fully cached prompt matches one block less
        full = len(prompt) // 4
        actual = len(bm.match_prefix(probe))
        assert actual == (min(predicted, full - 1) if len(prompt) % 4 == 0 else predicted), (i, prompt)
        rid = f"r{i}"
        _admit(bm, rid, prompt)
        bm.free(rid)
    diff = bm.events.read(seq)
    index.apply("w", "inc", BlockReport(diff.seq, diff.snapshot, diff.stored, diff.removed), block_size=4)
    assert index.num_blocks("w") == len(bm.events.read(0).stored) == bm.events.num_held() > 0


def test_adapter_roots_separate_chains_and_are_stable_across_processes() -> None:
    """A LoRA adapter's blocks never share a chain hash with the base model's or another adapter's,
    and the root is a digest (the same in a router and a worker whatever PYTHONHASHSEED says)."""
    import subprocess
    import sys

    from workers.block_hash import ROOT, adapter_root, chain_hashes

    tokens = list(range(1, 9))
    base = chain_hashes(tokens, 4)
    assert adapter_root("") == ROOT and chain_hashes(tokens, 4, root=adapter_root("")) == base
    sql, chat = chain_hashes(tokens, 4, root=adapter_root("sql")), chain_hashes(tokens, 4, root=adapter_root("chat"))
    assert len({*base, *sql, *chat}) == 6
    code = "from workers.block_hash import adapter_root; print(adapter_root('sql'))"
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."}).stdout.strip() for seed in ("1", "2")}
    assert seen == {str(adapter_root("sql"))}


def test_listeners_hear_every_change_and_only_changes():
    from workers.block_hash import Tier
    log = BlockEventLog()
    heard: list[int] = []
    listener = lambda: heard.append(log.seq)  # noqa: E731
    log.add_listener(listener)
    log.stored([1, 2])
    log.stored([1])  # already held: nothing a reader would see
    log.stored([2], Tier.HOST)  # the fastest tier is still the device: nothing to report either
    log.removed([2])  # device copy gone: now reported in host
    assert heard == [2, 3]
    log.remove_listener(listener)
    log.removed([1])
    assert heard == [2, 3]


def test_pending_blocks_are_refcounted_and_yield_to_real_tiers():
    from workers.block_hash import Tier
    from workers.engine.block_events import PendingBlocks
    log = BlockEventLog()
    pending = PendingBlocks(log)
    a, b = chain_hashes(list(range(8)), 4), chain_hashes(list(range(4)), 4)  # b is a's first block
    pending.add(a)
    pending.add(b)
    assert [log.tier(h) for h in a] == [Tier.PENDING, Tier.PENDING]
    diff = log.read(0)
    assert diff.snapshot and sorted(diff.stored) == sorted(a) and diff.stored_tiers == [int(Tier.PENDING)] * 2
    cursor = diff.seq
    log.stored(a[:1])  # the first block computed (the device copy wins)
    assert log.tier(a[0]) is Tier.DEVICE and log.read(cursor).stored_tiers == []
    pending.release(a)
    assert log.tier(a[0]) is Tier.DEVICE and log.tier(a[1]) is None  # a[1] never computed: gone
    assert len(pending) == 1  # b (= a[0]) still pending for the second request
    pending.release(b)
    assert len(pending) == 0 and log.tier(a[0]) is Tier.DEVICE
