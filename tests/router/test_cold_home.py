"""prefix_aware's ``cold_home`` (router/policies/cold_home.py): a prompt no worker holds goes to its
home -- the same worker from every router, whatever each router sent since the last report --
among the workers whose reported load is within the request's cost of the least; off (the default)
it is the least-loaded worker as before."""

from __future__ import annotations

import pytest

from router.policies import PolicyConfigError, RouteRequest, WorkerState, make_policy
from router.policies.cold_home import cold_home, score

PREFIX = list(range(1000, 1256))  # 16 blocks of 16


def ws(wid: str, reported: int = 0, own: int = 0) -> WorkerState:
    """A worker as one router sees it: ``reported`` outstanding tokens (every router sees the same)
    and ``own`` tokens this router routed there since that report."""
    return WorkerState(wid, f"{wid}:1", outstanding_tokens=reported, routed_tokens_since_report=own, kv_block_size=16)


def req(ids: list[int], rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, ids, 8)


def test_every_router_sends_a_new_prefix_to_the_same_worker():
    # three routers, each having just sent a burst of its own elsewhere: their views differ
    views = [[ws("w0", own=900), ws("w1"), ws("w2"), ws("w3")],
             [ws("w0"), ws("w1", own=900), ws("w2", own=300), ws("w3")],
             [ws("w0"), ws("w1"), ws("w2"), ws("w3", own=1200)]]
    homes = {make_policy("prefix_aware", cold_home=True).select(req(PREFIX + [7] * 16), v) for v in views}
    least = {make_policy("prefix_aware").select(req(PREFIX + [7] * 16), v) for v in views}
    assert len(homes) == 1  # one copy of the prefix, computed where all three sent it
    assert len(least) > 1  # the default: each router's own idlest worker, one copy each


def test_the_home_is_among_the_near_least_loaded_and_stable():
    r = req(PREFIX)
    first_block = hash(tuple(PREFIX[:16]))
    workers = [ws("w0", 0), ws("w1", 100), ws("w2", 100 + r.cost_tokens + 1), ws("w3", 50)]
    near = [w for w in workers if w.worker_id != "w2"]  # w2: beyond the least's load + this request's cost
    home = cold_home(r, first_block, workers, workers[0])
    assert home == max(near, key=lambda w: score(first_block, w.worker_id))
    # rendezvous hashing: a worker leaving that is not the home does not move it
    other = next(w for w in near if w is not home)
    assert cold_home(r, first_block, [w for w in workers if w is not other], workers[0]) == home
    # no full block: the fallback (least loaded)
    assert cold_home(req(PREFIX[:15]), None, workers, workers[0]) == workers[0]
    # a prompt sharing the first block has the same home, whatever follows it
    assert make_policy("prefix_aware", cold_home=True).select(req(PREFIX[:16] + [5] * 40), workers) == home.worker_id


def test_cold_home_is_off_by_default_and_checked():
    workers = [ws("w0", 300), ws("w1", 0), ws("w2", 200)]
    assert make_policy("prefix_aware").select(req(PREFIX), workers) == "w1"  # least loaded, as before
    with pytest.raises(PolicyConfigError, match="cold_home"):
        make_policy("prefix_aware", cold_home="yes")
