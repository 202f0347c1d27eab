"""Routing policies distribute as their docstrings say. Pure Python: no Ray, no model, no gRPC.

The helper ``_route`` plays the router: after each select it bumps the chosen worker's router-side
counters (in-flight, routed since report) the way the serving layer will.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import pytest

from protos.duet.worker.v1 import worker_pb2
from router.policies import (
    POLICIES,
    NoWorkersAvailable,
    PolicyConfigError,
    RouteRequest,
    RoutingPolicy,
    WorkerState,
    make_policy,
    policy_options,
)
from router.policies.base import log_fallback
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.policies.round_robin import RoundRobinPolicy


def _workers(n: int, **fields) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"10.0.0.{i}:50061", **fields) for i in range(n)]


def _set(workers: list[WorkerState], worker_id: str, **fields) -> list[WorkerState]:
    return [replace(w, **fields) if w.worker_id == worker_id else w for w in workers]


def _route(policy: RoutingPolicy, workers: list[WorkerState], requests: list[RouteRequest]):
    """Route ``requests`` in order, updating router-side counts; returns (picks, final workers)."""
    picks = []
    for req in requests:
        wid = policy.select(req, workers)
        picks.append(wid)
        workers = [replace(w, in_flight_requests=w.in_flight_requests + 1,
                           routed_requests_since_report=w.routed_requests_since_report + 1,
                           routed_tokens_since_report=w.routed_tokens_since_report + req.cost_tokens)
                   if w.worker_id == wid else w for w in workers]
    return picks, workers


def _requests(n: int, prompt_len: int = 10, max_tokens: int = 1, prefix: list[int] | None = None):
    """n requests with distinct prompts (optionally behind a shared prefix)."""
    prefix = prefix or []
    return [RouteRequest(f"r{i}", prefix + [1000 + i] * prompt_len, max_tokens) for i in range(n)]


# ------------------------------------------------------------------ messages
def test_cost_tokens_matches_outstanding_tokens_formula():
    assert RouteRequest("r", [1] * 100, max_tokens=20).cost_tokens == 119  # P + M - 1
    assert RouteRequest("r", [1] * 100).cost_tokens == 100  # max_tokens unknown


def test_load_tokens_docstring_example():
    w = WorkerState("w0", kv_block_size=16, kv_blocks_total=100, kv_blocks_used=10, outstanding_tokens=300,
                    routed_tokens_since_report=50)
    assert w.load_tokens == 510
    assert w.kv_usage == pytest.approx(0.1)
    assert WorkerState("new").load_tokens == 0 and WorkerState("new").kv_usage == 0.0


def test_worker_state_from_load_report():
    report = worker_pb2.LoadReport(worker_id="w3", incarnation="i1", num_running=2, num_waiting=1,
                                   outstanding_tokens=700, kv_block_size=16, kv_blocks_total=64,
                                   kv_blocks_used=8)
    w = WorkerState.from_load_report(report, endpoint="h:1", in_flight_requests=4, routed_tokens_since_report=9)
    assert (w.worker_id, w.endpoint, w.healthy, w.incarnation) == ("w3", "h:1", True, "i1")
    assert (w.num_running, w.num_waiting, w.outstanding_tokens) == (2, 1, 700)
    assert (w.kv_block_size, w.kv_blocks_total, w.kv_blocks_used) == (16, 64, 8)
    assert w.in_flight_requests == 4 and w.load_tokens == 8 * 16 + 700 + 9


# ------------------------------------------------------------------ registry
def test_registry_builds_every_policy():
    assert sorted(POLICIES) == ["least_loaded", "prefix_aware", "round_robin"]
    for name, cls in POLICIES.items():
        policy = make_policy(name)
        assert type(policy) is cls and policy.name == name
        assert isinstance(policy, RoutingPolicy)
        assert all(isinstance(v, int) for v in policy.counters().values())
    assert make_policy("prefix_aware", block_size=32, balance_rel=2).block_size == 32
    assert policy_options("prefix_aware")["block_size"] == 16


def test_registry_errors_list_the_valid_choices():
    with pytest.raises(PolicyConfigError, match="valid policies: least_loaded, prefix_aware, round_robin"):
        make_policy("fastest")
    with pytest.raises(PolicyConfigError, match="no option 'block_sz'.*valid options: balance_abs_tokens"):
        make_policy("prefix_aware", block_sz=16)
    with pytest.raises(PolicyConfigError, match=r"valid options: \(none\)"):
        make_policy("round_robin", block_size=16)
    with pytest.raises(PolicyConfigError, match="prefix_aware.block_size=0"):
        make_policy("prefix_aware", block_size=0)
    with pytest.raises(PolicyConfigError, match="prefix_aware.balance_rel=0.5"):
        make_policy("prefix_aware", balance_rel=0.5)
    with pytest.raises(ValueError):  # PolicyConfigError is a ValueError for generic callers
        make_policy("prefix_aware", balance_abs_tokens=-1)


# ---------------------------------------------------------- shared behaviour
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_workers_raises(name):
    policy = make_policy(name)
    with pytest.raises(NoWorkersAvailable, match="no workers registered"):
        policy.select(RouteRequest("r", [1, 2]), [])
    with pytest.raises(NoWorkersAvailable, match="2 known, all unhealthy"):
        policy.select(RouteRequest("r", [1, 2]), _workers(2, healthy=False))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_workers_are_never_selected(name):
    policy = make_policy(name)
    # w0 is unhealthy but idle and (for prefix_aware) holds every prompt; the others are busy.
    workers = [WorkerState("w0", healthy=False)] + [WorkerState(f"w{i}", outstanding_tokens=10_000) for i in (1, 2)]
    if name == "prefix_aware":
        policy.tree.insert("w0", policy_blocks(policy, list(range(128))))
    picks, _ = _route(policy, workers, _requests(20, prompt_len=128, prefix=list(range(128))))
    assert set(picks) <= {"w1", "w2"}


# --------------------------------------------------------------- round robin
def test_round_robin_cycles_evenly():
    picks, _ = _route(RoundRobinPolicy(), _workers(3), _requests(30))
    assert picks[:6] == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert Counter(picks) == {"w0": 10, "w1": 10, "w2": 10}


def test_round_robin_ignores_load_and_list_order():
    workers = _workers(3)[::-1]
    workers = _set(workers, "w0", outstanding_tokens=10**9)
    picks, _ = _route(RoundRobinPolicy(), workers, _requests(6))
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_round_robin_skips_unhealthy_and_welcomes_newcomers():
    policy, workers = RoundRobinPolicy(), _workers(3)
    picks, _ = _route(policy, workers, _requests(4))
    assert picks == ["w0", "w1", "w2", "w0"]
    workers = _set(workers, "w1", healthy=False)
    picks, _ = _route(policy, workers, _requests(4))
    assert picks == ["w2", "w0", "w2", "w0"]  # the docstring example
    workers = _set(workers, "w1", healthy=True) + [WorkerState("w3")]
    picks, _ = _route(policy, workers, _requests(4))
    assert picks == ["w1", "w2", "w3", "w0"]


# -------------------------------------------------------------- least loaded
def test_least_loaded_picks_the_smallest_load():
    policy = LeastLoadedPolicy()
    workers = _workers(3)
    workers = _set(workers, "w0", outstanding_tokens=5000)
    workers = _set(workers, "w1", outstanding_tokens=100)
    workers = _set(workers, "w2", outstanding_tokens=3000)
    assert policy.select(RouteRequest("r", [1]), workers) == "w1"
    # KV held counts too: w1's 400 blocks x 16 tokens make it the busiest.
    workers = _set(workers, "w1", kv_block_size=16, kv_blocks_used=400)
    assert policy.select(RouteRequest("r", [1]), workers) == "w2"


def test_least_loaded_follows_the_load():
    """The module docstring example: loads 0/500/1000, 30 requests of 100 tokens -> 15/10/5."""
    workers = _workers(3)
    workers = _set(workers, "w1", outstanding_tokens=500)
    workers = _set(workers, "w2", outstanding_tokens=1000)
    picks, final = _route(LeastLoadedPolicy(), workers, _requests(30, prompt_len=100))
    assert picks[:5] == ["w0"] * 5
    assert Counter(picks) == {"w0": 15, "w1": 10, "w2": 5}
    assert {w.load_tokens for w in final} == {1500}


def test_least_loaded_spreads_a_burst_between_reports():
    # All idle, no report arrives during the burst: router-side counts alone keep it even.
    picks, _ = _route(LeastLoadedPolicy(), _workers(3), _requests(30))
    assert Counter(picks) == {"w0": 10, "w1": 10, "w2": 10}


def test_least_loaded_ties_break_on_in_flight_then_id():
    workers = [WorkerState("w0", in_flight_requests=3), WorkerState("w1", in_flight_requests=1), WorkerState("w2")]
    assert LeastLoadedPolicy().select(RouteRequest("r", [1]), workers) == "w2"
    assert LeastLoadedPolicy().select(RouteRequest("r", [1]), workers[:2]) == "w1"


# -------------------------------------------------------------- prefix aware
SYSTEM = list(range(1, 257))  # a 256-token shared prefix = 16 blocks of 16


def _prompt(suffix: int, n: int = 20) -> list[int]:
    return SYSTEM + [5000 + suffix] * n


def test_prefix_aware_picks_the_worker_holding_the_prefix():
    policy, workers = PrefixAwarePolicy(), _workers(3)
    policy.tree.insert("w2", policy_blocks(policy, SYSTEM))  # w2 was sent the system prompt
    for i in range(5):
        assert policy.select(RouteRequest(f"r{i}", _prompt(i)), workers) == "w2"
    assert policy.num_prefix_hits == 5 and policy.num_matched_tokens == 5 * 256
    assert policy.num_imbalance_fallbacks == 0


def test_prefix_aware_prefers_the_longest_match():
    policy, workers = PrefixAwarePolicy(), _workers(3)
    conversation = _prompt(1, n=200)  # system prompt + a long conversation
    policy.tree.insert("w0", policy_blocks(policy, SYSTEM))
    policy.tree.insert("w1", policy_blocks(policy, conversation))
    workers = _set(workers, "w1", outstanding_tokens=2000)  # busier, but within the thresholds
    assert policy.select(RouteRequest("next-turn", conversation + [7] * 40), workers) == "w1"


def test_prefix_aware_falls_back_when_the_holder_is_overloaded(caplog):
    policy, workers = PrefixAwarePolicy(balance_abs_tokens=4096, balance_rel=1.5), _workers(3)
    policy.tree.insert("w0", policy_blocks(policy, SYSTEM))
    req = RouteRequest("r", _prompt(0))
    # Imbalance below the absolute threshold: keep the cache hit.
    workers = _set(workers, "w0", outstanding_tokens=4000)
    assert policy.select(req, workers) == "w0"
    # Above the absolute threshold but within 1.5x of the idlest: keep it too.
    workers = [replace(w, outstanding_tokens=14_000) for w in workers]
    workers = _set(workers, "w0", outstanding_tokens=20_000)
    assert policy.select(req, workers) == "w0"
    assert policy.num_imbalance_fallbacks == 0
    # Overloaded on both counts: least-loaded (w2 beats w1 on load), logged and counted.
    workers = _set(_workers(3), "w0", outstanding_tokens=20_000)
    workers = _set(workers, "w1", outstanding_tokens=300)
    with caplog.at_level(logging.DEBUG, logger="router.policies.prefix_aware"):
        assert policy.select(req, workers) == "w2"
    assert policy.num_imbalance_fallbacks == 1
    assert policy.counters()["imbalance_fallbacks"] == 1
    record = next(r for r in caplog.records if "balance thresholds" in r.getMessage())
    assert record.levelno == logging.WARNING and "w0" in record.getMessage()
    # The fallback taught the tree that w2 holds the prefix now; it wins the tie on load.
    assert policy.tree.match(policy_blocks(policy, SYSTEM)) == {"w0": 16, "w2": 16}
    workers = _set(workers, "w0", outstanding_tokens=0)
    workers = _set(workers, "w2", outstanding_tokens=100)
    assert policy.select(req, workers) == "w0"


def test_prefix_aware_without_a_match_is_least_loaded():
    policy, workers = PrefixAwarePolicy(), _workers(3)
    workers = _set(workers, "w0", outstanding_tokens=100)
    assert policy.select(RouteRequest("r", [1, 2, 3]), workers) == "w1"  # shorter than a block
    assert policy.select(RouteRequest("r", list(range(64))), workers) == "w1"
    assert policy.num_no_match == 2 and policy.num_prefix_hits == 0


def test_prefix_aware_spreads_a_hot_prefix_instead_of_hot_spotting():
    """40 requests sharing a 256-token system prompt, no load report in between: the first
    worker keeps them until the imbalance passes the thresholds, then the prefix replicates."""
    policy = PrefixAwarePolicy(balance_abs_tokens=4096)
    requests = [RouteRequest(f"r{i}", _prompt(i), max_tokens=128) for i in range(40)]  # cost 403 each
    picks, final = _route(policy, _workers(4), requests)
    counts = Counter(picks)
    assert picks[:11] == ["w0"] * 11  # 11 x 403 = 4433 > 4096: the 12th falls back
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert max(counts.values()) - min(counts.values()) <= 11
    loads = [w.load_tokens for w in final]
    assert max(loads) - min(loads) <= 4096 + 403  # never beyond the threshold plus one request
    assert policy.num_imbalance_fallbacks >= 3
    assert policy.num_no_match == 1  # only the very first request found nothing


def test_prefix_aware_forgets_workers_that_leave_or_restart(caplog):
    policy, workers = PrefixAwarePolicy(), _workers(2, incarnation="a")
    blocks = policy_blocks(policy, SYSTEM)
    policy.tree.insert("w0", blocks)
    policy.tree.insert("w1", blocks)
    policy.select(RouteRequest("r0", [1]), workers)  # learns incarnations
    with caplog.at_level(logging.INFO, logger="router.policies.prefix_aware"):
        policy.select(RouteRequest("r1", [1]), _set(workers, "w1", incarnation="b"))  # w1 restarted
    assert policy.tree.match(blocks) == {"w0": 16}
    assert "restarted" in caplog.text
    policy.select(RouteRequest("r2", [1]), [WorkerState("w1", incarnation="b")])  # w0 left
    assert policy.tree.match(blocks) == {}
    assert policy.num_worker_resets == 2
    # An unhealthy worker keeps its entries (it may come back with its cache).
    policy.tree.insert("w1", blocks)
    policy.select(RouteRequest("r3", [1]), [WorkerState("w1", healthy=False, incarnation="b"), WorkerState("w2")])
    assert policy.tree.match(blocks) == {"w1": 16}


def test_prefix_aware_bounds_the_tree_per_worker():
    policy = PrefixAwarePolicy(max_blocks_per_worker=32)
    _route(policy, _workers(1), [RouteRequest(f"r{i}", [i] * 160) for i in range(20)])  # 10 blocks each
    assert policy.tree.num_blocks("w0") == 32
    # Without an explicit cap the worker's reported KV capacity bounds it (in our block size).
    policy = PrefixAwarePolicy()
    workers = [WorkerState("w0", kv_block_size=32, kv_blocks_total=8)]  # 256 tokens = 16 of our blocks
    _route(policy, workers, [RouteRequest(f"r{i}", [i] * 160) for i in range(5)])
    assert policy.tree.num_blocks("w0") == 16


def test_prefix_aware_warns_once_on_block_size_mismatch(caplog):
    policy = PrefixAwarePolicy(block_size=16)
    workers = [WorkerState("w0", kv_block_size=32)]
    with caplog.at_level(logging.WARNING, logger="router.policies.prefix_aware"):
        for i in range(3):
            policy.select(RouteRequest(f"r{i}", [1] * 40), workers)
    assert caplog.text.count("prefix matches are approximate") == 1


def test_log_fallback_rate_limits_to_powers_of_two(caplog):
    logger = logging.getLogger("test.fallback")
    with caplog.at_level(logging.DEBUG, logger="test.fallback"):
        for n in range(1, 9):
            log_fallback(logger, n, "fell back for %s", "r")
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.WARNING, logging.DEBUG, logging.WARNING,
                      logging.DEBUG, logging.DEBUG, logging.DEBUG, logging.WARNING]
    assert caplog.records[-1].getMessage() == "fell back for r (fallback #8)"


def policy_blocks(policy: PrefixAwarePolicy, token_ids: list[int]) -> list[int]:
    from router.prefix_tree import block_hashes

    return block_hashes(token_ids, policy.block_size)
