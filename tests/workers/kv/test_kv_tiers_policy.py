"""``cache.tier_policy`` (workers/kv/tiers/policy.py) in the host tier: under ``arc`` blocks loaded back
(used again) outlast a burst of blocks that came in once, where ``lru`` lets the burst flush them; a
block that ARC gave up and that comes back is kept as one used again; both policies hold the byte
budget and account for every block through any sequence of puts, hits and drops; a node's shared
tier refuses anything but lru. (The engine's tokens with arc equal tiers off:
tests/workers/engine/test_kv_tiers_engine.py; which policy pays: benchmarks/tier_policy_sim.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.config import CacheConfig
from workers.errors import ConfigError
from workers.kv.tiers.block_file import seal
from workers.kv.tiers.host import HostTier
from workers.kv.tiers.policy import ARCOrder

from tests.workers.kv.test_kv_tiers_store import BLOCK_BYTES, block, digest

BLOCKS = [seal(digest(i), block(i)) for i in range(24)]


def _scan_survivors(policy: str) -> set[int]:
    """A 4-block tier: blocks 0-3 come in and are each loaded back twice (a shared document asked
    about again), then a scan of 6 one-off blocks comes through; which of 0-3 are still held."""
    host = HostTier(4 * BLOCK_BYTES, policy=policy)
    for b in BLOCKS[:4]:
        host.put(b)
    for _ in range(2):
        for b in BLOCKS[:4]:
            assert host.get(b.digest) is not None
    for b in BLOCKS[10:16]:
        host.put(b)
    assert host.bytes <= 4 * BLOCK_BYTES
    return {i for i in range(4) if BLOCKS[i].digest in host}


def test_arc_keeps_blocks_used_again_through_a_scan_and_lru_does_not():
    assert _scan_survivors("lru") == set()
    assert _scan_survivors("arc") == {1, 2, 3}  # the scan's first block had only T2 to take room from


def test_arc_readmits_a_ghost_as_used_again_and_adapts():
    order = ARCOrder(2)
    for key in ("a", "b"):
        order.prepare(key)
        order.admit(key)
    order.use("b")  # T1 = [a], T2 = [b]
    order.prepare("c")
    assert order.evict() == "a" and "a" in order.b1  # given up from T1, remembered as a ghost
    order.admit("c")
    order.prepare("a")  # back: recency would have kept it, so T1's share grows
    assert order.p == 1.0
    assert order.evict() == "b" and "b" in order.b2  # T1 is within its share now: T2 gives room
    order.admit("a")
    assert list(order.t2) == ["a"] and list(order.t1) == ["c"]  # readmitted as used again


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["lru", "arc"]), budget=st.integers(1, 6),
       ops=st.lists(st.tuples(st.sampled_from(["put", "get", "drop"]), st.integers(0, 11)), max_size=80))
def test_budget_and_accounting_hold_for_any_sequence(policy, budget, ops):
    host = HostTier(budget * BLOCK_BYTES, policy=policy)
    held: set[bytes] = set()
    for op, i in ops:
        d = BLOCKS[i].digest
        if op == "put":
            out = host.put(BLOCKS[i])
            held.add(d)
            held -= {b.digest for b in out}
            assert d in host  # never the block just put (it fits the budget)
        elif op == "get":
            assert (host.get(d) is not None) == (d in held)
        else:
            host.drop(d)
            held.discard(d)
        assert {b.digest for b in BLOCKS if b.digest in host} == held and len(host) == len(held)
        assert host.bytes == len(held) * BLOCK_BYTES <= budget * BLOCK_BYTES


def test_a_shared_node_tier_is_lru_only():
    CacheConfig(host_tier_bytes=1 << 20, tier_policy="arc")  # a process's own host tier: fine
    with pytest.raises(ConfigError, match="tier_policy='arc' with cache.host_tier_shared=true"):
        CacheConfig(host_tier_bytes=1 << 20, host_tier_shared=True, tier_policy="arc")
    with pytest.raises(ConfigError, match="tier_policy='lfu'.*lru, arc"):
        CacheConfig(host_tier_bytes=1 << 20, tier_policy="lfu")
