"""The drafter policy (router/policies/drafter.py) and the router's drafter directory
(router/drafters.py): which replica a speculative request drafts on. Least loaded, M:N by
construction (each target spreads over replicas, each replica serves several targets), a request
keeps its replica, a target's fan-out is bounded, no healthy replica means no drafts (counted)."""

from __future__ import annotations

import asyncio

import pytest

from router.drafters import DrafterDirectory, DrafterRouting
from router.policies.base import PolicyConfigError, RouteRequest, WorkerState
from router.policies.drafter import DrafterState, LeastLoadedAffinityPolicy, make_drafter_policy
from router.workers import MemberInfo, WorkerDirectory


def _target(name: str, pool: str = "drafters") -> WorkerState:
    return WorkerState(name, f"{name}:1", role="decode", drafter_pool=pool)


class Leases:
    """Drafter states whose in-flight counts follow the picks (what DrafterDirectory keeps)."""

    def __init__(self, *names: str, pool: str = "drafters") -> None:
        self.states = {n: DrafterState(n, f"{n}:9", pool) for n in names}
        self.targets: dict[str, dict[str, int]] = {n: {} for n in names}

    def snapshot(self) -> list[DrafterState]:
        return [DrafterState(s.drafter_id, s.endpoint, s.pool, s.healthy, num_requests=s.num_requests,
                             routed_since_report=s.routed_since_report, targets=dict(self.targets[n]))
                for n, s in self.states.items()]

    def pick(self, policy, rid: str, target: str) -> str | None:
        d = policy.select(RouteRequest(rid, [1, 2, 3]), _target(target), self.snapshot())
        if d is not None:
            s = self.states[d]
            self.states[d] = DrafterState(s.drafter_id, s.endpoint, s.pool, s.healthy,
                                          routed_since_report=s.routed_since_report + 1)
            self.targets[d][target] = self.targets[d].get(target, 0) + 1
        return d


def test_requests_of_two_targets_spread_m_to_n():
    leases, policy = Leases("d0", "d1"), LeastLoadedAffinityPolicy()
    picks = [leases.pick(policy, f"r{i}", t) for i, t in enumerate(["t0", "t1", "t0", "t1"])]
    assert picks == ["d0", "d1", "d1", "d0"]  # each target on both replicas, each replica serving both
    assert policy.counters()["drafter_routes"] == 4


def test_a_request_keeps_its_replica_while_it_is_healthy():
    leases, policy = Leases("d0", "d1"), LeastLoadedAffinityPolicy()
    first = leases.pick(policy, "r", "t0")
    for _ in range(3):  # a retry, a resume, a migrated request re-attaching (on another target)
        assert leases.pick(policy, "r", "t1") == first
    assert policy.counters()["drafter_affinity_hits"] == 3
    leases.states[first] = DrafterState(first, "x", "drafters", healthy=False)
    assert leases.pick(policy, "r", "t1") != first  # its replica died: another one


def test_fanout_bounds_the_replicas_one_target_uses():
    leases, policy = Leases("d0", "d1", "d2"), LeastLoadedAffinityPolicy(fanout=2)
    picks = {leases.pick(policy, f"r{i}", "t0") for i in range(9)}
    assert len(picks) == 2
    assert leases.pick(policy, "other", "t1") == "d2"  # another target still gets the idle replica


def test_no_healthy_replica_of_the_targets_pool_means_no_drafts():
    leases, policy = Leases("d0", pool="other_pool"), LeastLoadedAffinityPolicy()
    assert leases.pick(policy, "r", "t0") is None
    assert policy.counters()["drafter_none"] == 1


def test_options_are_checked():
    with pytest.raises(PolicyConfigError, match="fanout=0"):
        make_drafter_policy("least_loaded_affinity", fanout=0)
    with pytest.raises(PolicyConfigError, match="unknown drafter policy 'fastest'"):
        make_drafter_policy("fastest")


def test_drafter_members_go_to_the_drafter_directory_and_leases_count():
    """Members of role drafter are replicas, not workers: worker policies never see them; a worker
    carries the drafter pool it drafts on; a lease hands the replica's endpoint to the target."""
    async def scenario() -> None:
        directory = WorkerDirectory(poll_interval_s=10.0, poll_timeout_s=0.2)
        try:
            await directory.set_members([
                MemberInfo("decode-0", "127.0.0.1:1", "decode", "decode", False, "drafters"),
                MemberInfo("drafters-0", "127.0.0.1:2", "drafter", "drafters"),
                MemberInfo("drafters-1", "127.0.0.1:3", "drafter", "drafters", True)], wait=False)
            [worker] = directory.snapshot()
            assert (worker.worker_id, worker.drafter_pool) == ("decode-0", "drafters")
            states = {d.drafter_id: d for d in directory.drafters.snapshot()}
            assert set(states) == {"drafters-0", "drafters-1"} and not states["drafters-1"].healthy  # draining
            # make drafters-0 routable as a successful poll would
            d0 = directory.drafters._members["drafters-0"]
            d0.state = DrafterState("drafters-0", d0.endpoint, "drafters", healthy=True, incarnation="abc")
            routing = DrafterRouting(directory.drafters, LeastLoadedAffinityPolicy())
            route = RouteRequest("r1", [1, 2, 3])
            lease = routing.begin(route, worker, speculate=True)
            assert (lease.ref.worker_id, lease.ref.endpoint, lease.ref.incarnation) == ("drafters-0", "127.0.0.1:2", "abc")
            [s0] = [d for d in directory.drafters.snapshot() if d.drafter_id == "drafters-0"]
            assert s0.in_flight == 1 and s0.targets == {"decode-0": 1}
            routing.end(lease)
            [s0] = [d for d in directory.drafters.snapshot() if d.drafter_id == "drafters-0"]
            assert s0.in_flight == 0 and s0.targets == {}
            assert routing.begin(route, worker, speculate=False) is None  # opted out
            assert routing.begin(route, _target("decode-9", pool=""), speculate=True) is None  # no drafter pool
            await directory.set_members([MemberInfo("decode-0", "127.0.0.1:1", "decode", "decode")], wait=False)
            assert directory.drafters.snapshot() == [] and directory.snapshot()[0].drafter_pool == ""
        finally:
            await directory.close()

    asyncio.run(scenario())


def test_an_unreachable_replica_becomes_unhealthy():
    async def scenario() -> None:
        d = DrafterDirectory(poll_interval_s=0.05, poll_timeout_s=0.2, failure_threshold=2)
        try:
            d.set_members([MemberInfo("drafters-0", "127.0.0.1:1", "drafter", "drafters")])
            await asyncio.sleep(1.0)
            [s] = d.snapshot()
            assert not s.healthy and d.describe()[0]["last_error"]
        finally:
            await d.close()

    asyncio.run(scenario())
