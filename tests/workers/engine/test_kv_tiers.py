"""KVTiers without a model: evicted blocks go down with their digest, a host hit is loaded into the
blocks the scheduler allocates (device content restored byte for byte), and the swap-or-recompute
rule follows the measured costs (probing now and then so a slow outlier does not stick)."""

from __future__ import annotations

import torch

from workers.config import SchedulerConfig
from workers.engine.block_manager import BlockManager
from workers.engine.kv_tiers import KVTiers, key_digest
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.kv.tiers.host import HostTier
from workers.kv.tiers.store import TieredStore
from workers.sampling_params import SamplingParams

BS = 4


class TensorPool:
    """A runner's KV block pool and nothing else: [L, 2, num_blocks, bs, G, D] (BlockIO)."""

    def __init__(self, num_blocks: int) -> None:
        self.kv = torch.zeros(2, 2, num_blocks, BS, 1, 4)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv[:, :, block_ids].clone()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        self.kv[:, :, block_ids] = kv


def build(num_blocks: int = 4):
    pool = TensorPool(num_blocks)
    tiers = KVTiers(TieredStore(HostTier(1 << 20)), pool, BS, load_timeout_s=1.0)
    bm = BlockManager(num_blocks, BS, on_evict=tiers.evicted)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, lower_tiers=tiers)
    return pool, tiers, bm, sched


def run_prefill(pool: TensorPool, sched: Scheduler, seq: Sequence) -> None:
    """Schedule ``seq`` alone and 'compute' its KV: every slot of token t holds float(t). Then the
    start of the engine's next step: the blocks this one evicted are stored below (``take_ready``)."""
    sched.add(seq)
    out = sched.schedule()
    for chunk in out.chunks:
        for i, tok in enumerate(chunk.token_ids):
            pos = chunk.start_pos + i
            pool.kv[:, :, chunk.block_table[pos // BS], pos % BS] = float(tok)
    sched.commit(out)
    assert isinstance(sched.lower_tiers, KVTiers)
    sched.lower_tiers.take_ready()


def test_evicted_prefix_comes_back_from_host():
    pool, tiers, bm, sched = build()
    a = Sequence("a", list(range(1, 13)), SamplingParams(), 0)  # 3 blocks
    run_prefill(pool, sched, a)
    want = pool.read_blocks(bm.block_table("a")[:2])
    sched.remove(a)
    b = Sequence("b", list(range(100, 116)), SamplingParams(), 1)  # 4 blocks: evicts all of a's
    run_prefill(pool, sched, b)
    sched.remove(b)
    assert tiers.stats().stored_blocks == 3 and bm.cached_prefix(a.token_ids) == []
    a2 = Sequence("a2", list(range(1, 13)) + [13], SamplingParams(), 2)
    sched.add(a2)
    out = sched.schedule()
    # 3 blocks came back from host: only token 13 is computed
    assert [(c.start_pos, c.token_ids) for c in out.chunks] == [(12, [13])]
    assert torch.equal(pool.read_blocks(bm.block_table("a2")[:2]), want)
    assert tiers.stats().host_hits == 3


def test_key_digest_matches_sequence_digests():
    pool, tiers, bm, sched = build()
    a = Sequence("a", list(range(1, 10)), SamplingParams(), 0)
    run_prefill(pool, sched, a)
    keys = [bm._blocks[b].key for b in bm.block_table("a")[:2]]
    assert [key_digest(k) for k in keys] == tiers.digests(a, 2)


def test_swap_or_recompute_rule_follows_measurements():
    pool, tiers, bm, sched = build()
    assert not tiers.recompute_is_cheaper()  # nothing measured: load
    tiers.observe_prefill(64, 0.064)  # 1 ms a token: a block of 4 costs 4 ms to recompute
    tiers.loaded(1, 0, 0.001)  # 1 ms to load a block
    assert not tiers.recompute_is_cheaper()
    for _ in range(40):
        tiers.loaded(1, 0, 0.050)  # the host copy got slow: 50 ms a block
    assert tiers.recompute_is_cheaper()
    a = Sequence("a", list(range(1, 13)), SamplingParams(), 0)
    run_prefill(pool, sched, a)
    sched.remove(a)
    b = Sequence("b", list(range(100, 116)), SamplingParams(), 1)
    run_prefill(pool, sched, b)  # a's blocks are in host now
    sched.remove(b)
    a2 = Sequence("a2", list(range(1, 14)), SamplingParams(), 2)
    answers = [tiers.match(a2, 0, 3) is not None for _ in range(KVTiers.PROBE_EVERY * 2)]
    assert answers.count(True) == 2  # only the probes load


def test_evictions_are_copied_at_once_and_stored_by_the_next_step():
    """An admission's evictions are copied out of the device at once (the blocks are overwritten
    right after) but stored below only at the next step's start, or before anything looks below
    the device: a match in the same step finds them, with the contents they had when evicted."""
    pool, tiers, bm, sched = build()
    a = Sequence("a", list(range(1, 13)), SamplingParams(), 0)  # 3 blocks
    run_prefill(pool, sched, a)
    want = pool.read_blocks(bm.block_table("a")[:3])
    sched.remove(a)
    sched.add(Sequence("b", list(range(100, 116)), SamplingParams(), 1))  # 4 blocks: evicts a's 3
    out = sched.schedule()
    assert tiers.num_pending == 3 and tiers.stats().stored_blocks == 0  # copied, not stored yet
    (chunk,) = out.chunks
    for i, tok in enumerate(chunk.token_ids):  # b's prefill overwrites a's old blocks
        pool.kv[:, :, chunk.block_table[i // BS], i % BS] = float(tok)
    sched.commit(out)
    sched.remove(sched.running[0])
    a2 = Sequence("a2", list(range(1, 13)) + [13], SamplingParams(), 2)
    load = tiers.match(a2, 0, 3)  # looks below: stores the pending blocks first
    assert tiers.num_pending == 0 and tiers.stats().stored_blocks == 3
    assert load is not None and load.num_blocks == 3
    assert torch.equal(torch.cat(load.kv, dim=2), want)  # a's contents, not b's


def test_memoised_key_digests_equal_the_walk():
    """KeyDigests (the eviction path's digest) equals key_digest for chains evicted in any order,
    for keys sharing parents, for equal keys that are other objects, and past its capacity."""
    import random

    from workers.engine.kv_tiers import KeyDigests, key_digest

    rng = random.Random(0)
    memo = KeyDigests(capacity=16)
    keys: list[tuple] = []
    for _ in range(300):
        parent = rng.choice(keys) if keys and rng.random() < 0.8 else rng.choice([None, 7])
        keys.append((parent, tuple(rng.randrange(1000) for _ in range(BS))))
    for key in rng.sample(keys, len(keys)) + keys:
        assert memo(key) == key_digest(key)
    twin = (keys[-1][0], tuple(keys[-1][1]))  # an equal key, another object
    assert memo(twin) == key_digest(keys[-1])
