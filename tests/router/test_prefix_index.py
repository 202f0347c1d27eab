"""PrefixIndex (router/prefix_index.py) and prefix_aware routing on reported holdings: routers that
never sent a prefix anywhere still route it to the worker that holds it; pending sends expire."""

from __future__ import annotations

from router.policies import RouteRequest, WorkerState, make_policy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.prefix_index import BlockReport, PrefixIndex
from workers.block_hash import chain_hashes

PROMPT = list(range(100, 140))  # 10 blocks of 4


def test_snapshot_diff_restart_and_forget():
    index = PrefixIndex()
    assert index.cursor("w0", "inc-a") == (0, "inc-a")
    index.apply("w0", "inc-a", BlockReport(5, True, chain_hashes(PROMPT[:16], 4)), block_size=4)
    assert index.match(PROMPT) == {"w0": 4} and index.cursor("w0") == (5, "inc-a")
    index.apply("w0", "inc-a", BlockReport(7, False, chain_hashes(PROMPT[:24], 4)[4:], chain_hashes(PROMPT, 4)[3:4]),
                block_size=4)
    assert index.match(PROMPT) == {"w0": 3}  # block 3 dropped: blocks 4, 5 are useless without it
    index.apply("w0", "inc-b", BlockReport(1, False, chain_hashes(PROMPT[:8], 4)), block_size=4)  # restarted
    assert index.match(PROMPT) == {"w0": 2} and index.num_snapshots == 2
    index.forget("w0")
    assert index.match(PROMPT) == {} and not index.knows("w0")


def _workers(**load: int) -> list[WorkerState]:
    return [WorkerState(w, f"{w}:1", outstanding_tokens=n, kv_block_size=4, incarnation="i") for w, n in load.items()]


def test_policy_routes_on_reported_holdings_not_on_its_own_sends():
    index = PrefixIndex()
    for wid in ("w0", "w1"):
        index.apply(wid, "i", BlockReport(1, True, []), block_size=4)
    index.apply("w1", "i", BlockReport(2, False, chain_hashes(PROMPT[:32], 4)), block_size=4)
    policy = make_policy("prefix_aware", index, block_size=4)
    # w1 is busier but holds 8 blocks: a router that sent nothing yet routes there
    assert policy.select(RouteRequest("r1", PROMPT + [1]), _workers(w0=0, w1=100)) == "w1"
    assert policy.counters()["prefix_hits"] == 1 and policy.counters()["tree_blocks"] == 0


def test_pending_sends_count_until_they_expire():
    now = [0.0]
    index = PrefixIndex()
    for wid in ("w0", "w1"):
        index.apply(wid, "i", BlockReport(1, True, []), block_size=4)
    policy = PrefixAwarePolicy(index, lambda: now[0], block_size=4, pending_s=1.0)
    first = policy.select(RouteRequest("r1", PROMPT), _workers(w0=0, w1=0))
    other = "w1" if first == "w0" else "w0"
    # the worker has not reported the blocks yet: this router's own send still counts
    loads = {first: 50, other: 0}
    assert policy.select(RouteRequest("r2", PROMPT + [7]), _workers(**loads)) == first
    now[0] = 5.0  # expired, and the worker never reported holding it (evicted, or never computed)
    assert policy.select(RouteRequest("r3", PROMPT + [8]), _workers(**loads)) == other


def test_workers_without_reports_fall_back_to_the_sent_tree():
    index = PrefixIndex()
    policy = make_policy("prefix_aware", index, block_size=4)
    first = policy.select(RouteRequest("r1", PROMPT), _workers(w0=0, w1=0))
    assert policy.counters()["tree_blocks"] == 10
    loads = {first: 50, ("w1" if first == "w0" else "w0"): 0}
    assert policy.select(RouteRequest("r2", PROMPT + [3]), _workers(**loads)) == first


def test_pending_blocks_match_for_routing_but_not_for_pulls_and_stale_reports_are_dropped():
    from workers.block_hash import Tier
    index = PrefixIndex()
    hashes = chain_hashes(PROMPT, 4)
    index.apply("w0", "i", BlockReport(3, True, hashes[:4], (), [0, 0, int(Tier.PENDING), int(Tier.PENDING)]),
                block_size=4)
    assert index.match_tiers(PROMPT) == {"w0": [Tier.DEVICE, Tier.DEVICE, Tier.PENDING, Tier.PENDING]}
    assert index.match(PROMPT) == {"w0": 2}  # what a prefix pull could read
    index.apply("w0", "i", BlockReport(5, False, hashes[2:4]), block_size=4)  # computed
    assert index.match(PROMPT) == {"w0": 4}
    index.apply("w0", "i", BlockReport(4, False, (), hashes[:4]), block_size=4)  # an older read arriving late
    assert index.match(PROMPT) == {"w0": 4} and index.num_stale == 1 and index.cursor("w0") == (5, "i")


def test_policy_routes_a_new_prefix_to_the_worker_computing_it():
    from workers.block_hash import Tier
    index = PrefixIndex()
    hashes = chain_hashes(PROMPT, 4)
    index.apply("w1", "i", BlockReport(1, True, hashes, (), [int(Tier.PENDING)] * len(hashes)), block_size=4)
    index.apply("w0", "i", BlockReport(1, True, []), block_size=4)
    policy = PrefixAwarePolicy(index, block_size=4)  # a router that never sent this prompt anywhere
    chosen = policy.select(RouteRequest("r", PROMPT + [7, 7, 7, 7]), _workers(w0=0, w1=200))
    assert chosen == "w1" and policy.counters()["matched_pending_blocks"] == len(hashes)


def test_pending_prompt_tokens_count_in_the_load_of_a_new_prefix_choice():
    from workers.block_hash import Tier
    index = PrefixIndex()
    other = chain_hashes(list(range(500, 532)), 4)  # another router's prompt, just admitted by w0
    index.apply("w0", "i", BlockReport(1, True, other, (), [int(Tier.PENDING)] * len(other)), block_size=4)
    index.apply("w1", "i", BlockReport(1, True, []), block_size=4)
    assert index.pending_tokens("w0") == len(other) * 4 and index.pending_tokens("w1") == 0
    plain, aware = PrefixAwarePolicy(block_size=4), PrefixAwarePolicy(index, block_size=4)
    workers = _workers(w0=0, w1=0)  # the last poll saw both idle
    assert plain.select(RouteRequest("r", PROMPT), workers) == "w0"  # the plain path: a tie, by id
    assert aware.select(RouteRequest("r", PROMPT), workers) == "w1"  # w0 is busy with a pending prompt
    index.apply("w0", "i", BlockReport(2, False, other), block_size=4)  # computed: on the device, not pending
    assert index.pending_tokens("w0") == 0
    index.apply("w0", "i", BlockReport(3, False, (), other), block_size=4)
    assert index.pending_tokens("w0") == 0 and index.num_blocks("w0") == 0
