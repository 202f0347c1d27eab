"""prefix_aware routing on tiered holdings (router/prefix_index.py, router/policies/prefix_aware.py):
a device hit beats a host hit beats a disk hit beats recompute, by the weights in the policy's
docstring, and load still wins past the balance thresholds."""

from __future__ import annotations

import pytest

from router.policies import PolicyConfigError, RouteRequest, WorkerState, make_policy
from router.prefix_index import BlockReport, PrefixIndex
from workers.block_hash import Tier, adapter_root, chain_hashes

PROMPT = list(range(100, 140))  # 10 blocks of 4
HASHES = chain_hashes(PROMPT, 4)


def _workers(**load: int) -> list[WorkerState]:
    return [WorkerState(w, f"{w}:1", outstanding_tokens=n, kv_block_size=4, incarnation="i") for w, n in load.items()]


def _index(**holdings: list[int]) -> PrefixIndex:
    """worker id -> the tier of each leading block of PROMPT it holds."""
    index = PrefixIndex()
    for wid, tiers in holdings.items():
        index.apply(wid, "i", BlockReport(1, True, HASHES[:len(tiers)], (), tiers), block_size=4)
    return index


def policy_of(index: PrefixIndex, **opts):
    """pending_s=0: only the reported holdings count (no router-side memory of earlier selects)."""
    return make_policy("prefix_aware", index, pending_s=0.0, **opts)


def test_index_keeps_the_tier_and_follows_moves():
    index = _index(w0=[Tier.DEVICE] * 6)
    assert index.match_tiers(PROMPT) == {"w0": [Tier.DEVICE] * 6}
    # blocks 3..5 evicted into host, block 5 then spilled to disk: reported again with their tier
    index.apply("w0", "i", BlockReport(2, False, HASHES[3:6], (), [Tier.HOST, Tier.HOST, Tier.DISK]), block_size=4)
    assert index.match_tiers(PROMPT) == {"w0": [Tier.DEVICE] * 3 + [Tier.HOST] * 2 + [Tier.DISK]}
    assert index.match(PROMPT) == {"w0": 6} and index.num_blocks("w0") == 6
    index.apply("w0", "i", BlockReport(3, False, (), HASHES[5:6]), block_size=4)  # deleted from disk
    assert index.match_tiers(PROMPT) == {"w0": [Tier.DEVICE] * 3 + [Tier.HOST] * 2}
    # a report without tiers (no lower tiers on that worker) is all device
    index.apply("w1", "i", BlockReport(1, True, HASHES[:2]), block_size=4)
    assert index.match_tiers(PROMPT)["w1"] == [Tier.DEVICE] * 2
    # an adapter's chain is its own
    assert index.match_tiers(PROMPT, root=adapter_root("sql")) == {}


@pytest.mark.parametrize("fast, slow", [(Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK)])
def test_a_faster_tier_wins_at_equal_length_and_load(fast, slow):
    index = _index(w0=[slow] * 8, w1=[fast] * 8, w2=[])
    policy = policy_of(index, block_size=4)
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=0, w1=0, w2=0)) == "w1"
    assert policy.counters()[f"matched_{fast.name.lower()}_blocks"] == 8


def test_a_disk_hit_beats_recompute():
    index = _index(w0=[Tier.DISK] * 8, w1=[])
    policy = policy_of(index, block_size=4)
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=0, w1=0)) == "w0"  # w1 ties on load
    assert policy.counters()["matched_disk_blocks"] == 8 and policy.counters()["no_match"] == 0


def test_weights_trade_length_for_tier():
    """The docstring's example: 4 device blocks (4.0) < 8 host blocks (7.2); 8 disk blocks (4.0) tie
    with 4 device blocks and the lower load takes it."""
    policy = policy_of(_index(w0=[Tier.DEVICE] * 4, w1=[Tier.HOST] * 8), block_size=4)
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=0, w1=10)) == "w1"
    policy = policy_of(_index(w0=[Tier.DEVICE] * 4, w1=[Tier.DISK] * 8), block_size=4)
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=10, w1=0)) == "w1"
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=0, w1=10)) == "w0"
    # 7 device blocks beat 8 disk blocks (7.0 > 4.0) and 8 host blocks beat 7 device (7.2 > 7.0)
    policy = policy_of(_index(w0=[Tier.DEVICE] * 7, w1=[Tier.DISK] * 8), block_size=4)
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=10, w1=0)) == "w0"
    policy = policy_of(_index(w0=[Tier.DEVICE] * 7, w1=[Tier.HOST] * 8), block_size=4)
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=0, w1=10)) == "w1"


def test_load_still_wins_past_the_thresholds():
    index = _index(w0=[Tier.DEVICE] * 8, w1=[Tier.HOST] * 8, w2=[])
    policy = policy_of(index, block_size=4, balance_abs_tokens=100, balance_rel=1.5)
    # w0 (device) overloaded against the idlest (w2): the imbalance fallback routes to the least loaded
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=1000, w1=500, w2=0)) == "w2"
    assert policy.counters()["imbalance_fallbacks"] == 1
    # within the thresholds the device holder keeps it even though it is busier
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=90, w1=0, w2=0)) == "w0"


def test_weights_are_options_and_validated():
    index = _index(w0=[Tier.DEVICE] * 4, w1=[Tier.HOST] * 8)
    policy = policy_of(index, block_size=4, host_weight=0.4, disk_weight=0.2)  # 3.2 < 4.0
    assert policy.select(RouteRequest("r", PROMPT + [1]), _workers(w0=10, w1=0)) == "w0"
    for bad in ({"host_weight": 1.5}, {"disk_weight": -0.1}, {"host_weight": 0.3, "disk_weight": 0.5},
                {"host_weight": True}):
        with pytest.raises(PolicyConfigError, match="prefix_aware"):
            policy_of(index, block_size=4, **bad)
    policy2 = policy_of(_index(w0=[Tier.DISK] * 8, w1=[]), block_size=4, disk_weight=0.0)
    assert policy2.select(RouteRequest("r", PROMPT + [1]), _workers(w0=10, w1=0)) == "w1"  # worth nothing: least loaded
    assert policy2.counters()["no_match"] == 1
