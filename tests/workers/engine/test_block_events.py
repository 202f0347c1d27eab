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
