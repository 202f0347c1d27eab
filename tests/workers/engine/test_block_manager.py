"""Block manager: ref counts, prefix reuse, LRU eviction, no leaks."""

from workers.engine.block_manager import BlockManager
from workers.sampling_params import SamplingParams
from workers.engine.sequence import Sequence


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), 0)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Admit like the scheduler does: take prefix hits, allocate the rest, mark all computed."""
    cached = bm.match_prefix(s)
    s.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return cached


def test_allocate_and_free_restores_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))  # 3 blocks
    admit(bm, a)
    assert len(bm.block_table("a")) == 3
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8
    assert bm.block_table("a") == []


def test_prefix_reuse_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    cached = admit(bm, b)
    assert cached == bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    assert bm.num_free_blocks == 8 - 3 - 1
    bm.free("a")  # shared blocks still referenced by b
    assert bm.num_free_blocks == 8 - 3
    bm.free("b")
    assert bm.num_free_blocks == 8
    stats = bm.stats()
    assert stats.prefix_cache_hits == 2


def test_prefix_key_depends_on_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block content, different first block: no hit at all
    assert bm.match_prefix(seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_fully_cached_prompt_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq("a", list(range(8))))
    assert len(bm.match_prefix(seq("b", list(range(8))))) == 1  # not 2: last block recomputed


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq("a", [1, 2, 3, 4, 9])
    admit(bm, a)  # blocks for (1,2) (3,4) and partial (9)
    bm.free("a")
    assert bm.stats().num_cached_blocks == 2
    # a hit after free revives the cached block
    assert len(bm.match_prefix(seq("b", [1, 2, 3, 4, 5]))) == 2
    # Fresh blocks come from the free queue, which evicts the partial tail first (freed first, reversed),
    # then (3,4), then (1,2) - tail before head.
    c = seq("c", [7, 7, 7, 7, 7, 7, 7, 7])
    assert bm.allocate(c, 2)
    assert bm.stats().num_cached_blocks == 2  # tail block had no key
    c.num_computed_tokens = 2
    assert bm.allocate(c, 2)
    assert bm.stats().num_cached_blocks == 1
    assert len(bm.match_prefix(seq("d", [1, 2, 3, 4, 5]))) == 1  # (1,2) survives, (3,4) evicted


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq("a", list(range(20)))
    assert not bm.allocate(a, 20)
    assert bm.num_free_blocks == 3 and bm.block_table("a") == []


def test_no_leak_after_many_aborts():
    bm = BlockManager(num_blocks=16, block_size=4)
    live: list[str] = []
    for i in range(60):
        s = seq(f"r{i}", [i % 3] * (5 + i % 7))  # shared prefixes: many hits and shared blocks
        admit(bm, s)
        live.append(s.request_id)
        if len(live) > 3:
            bm.free(live.pop(i % 4))
    for rid in live:
        bm.free(rid)
    assert bm.num_free_blocks == 16
    assert bm.stats().prefix_cache_hits > 0


def test_release_leading_frees_window_blocks_keeps_keys_and_frees_the_rest_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(14)))  # 4 blocks, 3 full and keyed
    admit(bm, a)
    table = list(bm.block_table("a"))
    assert bm.release_leading("a", 2) == 2
    assert bm.block_table("a")[:2] == [0, 0] and bm.block_table("a")[2:] == table[2:]
    assert bm.num_held_blocks("a") == 2 and bm.num_free_blocks == 6
    assert bm.release_leading("a", 2) == 0  # idempotent
    assert bm.release_leading("a", 10) == 1  # never the newest block
    # released blocks keep their keys: a new request with the same prefix still takes them
    b = seq("b", list(range(9)))
    assert admit(bm, b) == table[:2]
    a.append_token(99)
    a.append_token(98)  # 16 tokens: the 4th block fills; keys chain from the remembered parent
    a.num_computed_tokens = 16
    bm.cache_computed_blocks(a)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    c = seq("c", list(range(14)) + [99, 98, 5])
    assert admit(bm, c) == table  # the whole chain, 4 blocks, is still cached
