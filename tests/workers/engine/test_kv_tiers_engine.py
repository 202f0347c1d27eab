"""Lower KV tiers through the engine: greedy tokens are identical with tiers on and off on a
multi-turn workload whose earlier turns were evicted to host and to disk (a device cache of 12
blocks forces it), a preempted request swaps back from host instead of recomputing and decodes the
same tokens, a corrupted disk block is refused, counted and recomputed, a disk read that misses its
deadline recomputes, and no file is left after close."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from testkit.greedy import NEW_TOKENS, PROMPTS
from workers.engine.loop import LoadSnapshot
from workers.errors import ConfigError
from workers.llm import LLM
from workers.sampling_params import SamplingParams

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 16 tokens, 3 kv heads x 64, float32
DEVICE = dict(num_blocks=12, block_size=16, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def multi_turn(llm: LLM, turns: int = 3, convs: int = 4,
               before_turn: Callable[[int], None] | None = None) -> list[list[int]]:
    """``convs`` conversations of ``turns`` turns, round robin, each turn one greedy request whose
    prompt is the conversation so far (4 x ~100+ tokens of history > the 192-token device cache).
    before_turn(t): called before turn t's requests."""
    tok = llm.engine.tokenizer
    hist = [tok.encode(f"<|im_start|>system\nYou are assistant number {i}. Answer questions about topic "
                       f"{i * 7} briefly, kindly and with care for details.<|im_end|>\n") for i in range(convs)]
    outs = []
    for turn in range(turns):
        if before_turn is not None:
            before_turn(turn)
        for i in range(convs):
            hist[i] += tok.encode(f"<|im_start|>user\nTell me fact {turn} about {i}.<|im_end|>\n"
                                  "<|im_start|>assistant\n")
            out = llm.generate([hist[i]], GREEDY)[0]
            outs.append(out.token_ids)
            hist[i] += out.token_ids
    return outs


@pytest.fixture(scope="module")
def tiers_off(smollm2_path: Path) -> list[list[int]]:
    llm = LLM(str(smollm2_path), host_tier_bytes=0, **DEVICE)
    assert llm.engine.tiers is None
    return multi_turn(llm)


def test_multi_turn_identical_with_host_tier(smollm2_path: Path, tiers_off):
    llm = LLM(str(smollm2_path), host_tier_bytes=256 * BLOCK_BYTES, **DEVICE)
    assert multi_turn(llm) == tiers_off
    t = llm.engine.stats().tiers
    assert t.host_hits > 0 and t.stored_blocks > 0 and t.refused_corrupt == t.refused_foreign == 0
    assert t.disk_blocks == 0
    load = LoadSnapshot.of(llm.engine)  # what GetLoad and /metrics report
    assert (load.tier_host_hits, load.tier_host_bytes, load.tier_bytes_loaded) == (t.host_hits, t.host_bytes,
                                                                                  t.bytes_loaded)
    llm.engine.close()


def test_host_tier_is_on_by_default(smollm2_path: Path, tiers_off):
    """host_tier_bytes 'auto' (the default): a host tier twice the device cache (this machine has far
    more than 8x its 12 blocks free), serving the evicted history with tokens identical to tiers off."""
    from workers.kv.tiers.budget import DEVICE_MULTIPLE

    llm = LLM(str(smollm2_path), **DEVICE)
    assert llm.config.cache.host_tier_bytes == "auto"
    assert llm.engine.tiers.store.host.capacity_bytes == DEVICE_MULTIPLE * DEVICE["num_blocks"] * BLOCK_BYTES
    assert llm.engine.tiers.store.disk is None  # the disk tier stays off by default
    assert multi_turn(llm) == tiers_off
    assert llm.engine.stats().tiers.host_hits > 0
    llm.engine.close()
    no_prefix = LLM(str(smollm2_path), enable_prefix_caching=False, **DEVICE)
    assert no_prefix.engine.tiers is None  # auto is off without prefix caching
    no_prefix.engine.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_multi_turn_identical_with_host_and_disk(smollm2_path: Path, tmp_path: Path, tiers_off, policy):
    # 4 host blocks: most history spills to disk and comes back through it (the host tier's policy
    # decides which blocks go down first: never what a request reads)
    llm = LLM(str(smollm2_path), host_tier_bytes=4 * BLOCK_BYTES, disk_tier_bytes=256 * BLOCK_BYTES,
              disk_tier_dir=str(tmp_path), tier_load_timeout_s=60.0, tier_policy=policy, **DEVICE)
    assert llm.engine.tiers.store.host.policy == policy
    assert multi_turn(llm) == tiers_off
    t = llm.engine.stats().tiers
    assert t.disk_hits > 0 and t.host_hits > 0 and t.bytes_to_disk > 0 and t.deadline_misses == 0
    assert t.refused_corrupt == t.refused_foreign == 0
    disk_dir = llm.engine.tiers.store.disk.dir
    assert list(disk_dir.glob("*.kvb"))
    llm.engine.close()
    assert not disk_dir.exists() and list(tmp_path.iterdir()) == []  # no leaked files


def test_corrupt_disk_blocks_are_refused_and_recomputed(smollm2_path: Path, tmp_path: Path, tiers_off):
    llm = LLM(str(smollm2_path), host_tier_bytes=4 * BLOCK_BYTES, disk_tier_bytes=256 * BLOCK_BYTES,
              disk_tier_dir=str(tmp_path), tier_load_timeout_s=60.0, **DEVICE)
    disk = llm.engine.tiers.store.disk
    corrupted: set[Path] = set()

    def damage(turn: int) -> None:  # flip one payload bit of every block file written so far
        disk._pool.submit(lambda: None).result()  # the queued writes have landed
        for path in set(disk.dir.glob("*.kvb")) - corrupted:
            raw = bytearray(path.read_bytes())
            raw[-3] ^= 0x04
            path.write_bytes(bytes(raw))
            corrupted.add(path)

    assert multi_turn(llm, before_turn=damage) == tiers_off  # never served: recomputed
    t = llm.engine.stats().tiers
    # blocks written after a turn's damage and read back within that turn are intact (disk hits)
    assert corrupted and t.refused_corrupt > 0 and t.refused_foreign == 0
    llm.engine.close()


def test_disk_read_past_deadline_recomputes(smollm2_path: Path, tmp_path: Path, tiers_off):
    llm = LLM(str(smollm2_path), host_tier_bytes=4 * BLOCK_BYTES, disk_tier_bytes=256 * BLOCK_BYTES,
              disk_tier_dir=str(tmp_path), tier_load_timeout_s=0.05, **DEVICE)
    disk = llm.engine.tiers.store.disk
    stall = threading.Event()

    def hang_disk(turn: int) -> None:  # from turn 1 on, every disk read queues behind a stuck one
        if turn == 1:
            disk._pool.submit(stall.wait)

    try:
        outs = multi_turn(llm, before_turn=hang_disk)
    finally:
        stall.set()
    assert outs == tiers_off
    t = llm.engine.stats().tiers
    assert t.deadline_misses > 0 and t.disk_hits == 0
    llm.engine.close()


def test_preemption_swaps_from_host(smollm2_path: Path):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    tight = dict(num_blocks=12, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    off = LLM(str(smollm2_path), host_tier_bytes=0, **tight)
    want = [o.token_ids for o in off.generate(PROMPTS, params)]
    assert off.engine.stats().num_preemptions > 0
    on = LLM(str(smollm2_path), host_tier_bytes=64 * BLOCK_BYTES, **tight)
    assert [o.token_ids for o in on.generate(PROMPTS, params)] == want
    s = on.engine.stats()
    assert s.num_preemptions > 0 and s.tiers.host_hits > 0
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    on.engine.close()


def test_write_blocks_equals_index_copy(smollm2_path: Path):
    """The CPU runner writes block by block (the tiers' load path); the cache must end up as the
    plain index_copy_ along the block axis leaves it, for blocks in any order, also cast from
    another dtype, and read_blocks must give them back."""
    import torch

    llm = LLM(str(smollm2_path), **DEVICE)
    runner = llm.engine.runner
    want = runner._blocks_view().clone()  # [L, 2, NB, bs, G, D]
    ids = [7, 2, 11, 3]
    kv = torch.randn(*want.shape[:2], len(ids), *want.shape[3:], generator=torch.Generator().manual_seed(0))
    want.index_copy_(2, torch.tensor(ids), kv)
    runner.write_blocks(ids, kv)
    assert torch.equal(runner._blocks_view(), want)
    assert torch.equal(runner.read_blocks(ids), kv)
    half = kv.to(torch.bfloat16)  # cast on the way in, as index_copy_ after .to(cache dtype)
    want.index_copy_(2, torch.tensor(ids), half.to(want.dtype))
    runner.write_blocks(ids, half)
    assert torch.equal(runner._blocks_view(), want)
    llm.engine.close()


@pytest.mark.parametrize("kwargs, names", [
    (dict(host_tier_bytes=0, disk_tier_bytes=1 << 20), ("cache.disk_tier_bytes", "cache.host_tier_bytes")),
    (dict(host_tier_bytes=1 << 20, enable_prefix_caching=False), ("cache.host_tier_bytes", "enable_prefix_caching")),
    (dict(disk_tier_bytes=1 << 20, enable_prefix_caching=False), ("cache.disk_tier_bytes", "enable_prefix_caching")),
    (dict(host_tier_bytes="1GiB"), ("cache.host_tier_bytes", "'auto'")),  # sizes are parsed at the config's edge
    (dict(host_tier_bytes=-1), ("cache.host_tier_bytes", ">= 0")),
    (dict(host_tier_bytes=1 << 20, tier_policy="lfu"), ("cache.tier_policy",)),
])
def test_config_refuses_naming_the_keys(kwargs, names):
    from workers.config import CacheConfig

    with pytest.raises(ConfigError) as e:
        CacheConfig(**kwargs)
    assert all(n in str(e.value) for n in names)
