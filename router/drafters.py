"""DrafterDirectory: the router's view of the drafter replicas (membership, load, health), and
``DrafterRouting``, which gives a speculative request its replica.

Drafter replicas are members of the controller's list like workers, with role ``drafter``
(router/workers.py hands them here, so worker policies never see them). The router never sends a
drafter a request: it polls each replica's ``GetLoad`` every ``poll_interval_s`` (healthy while the
latest poll succeeded; ``failure_threshold`` failures in a row make it unhealthy), and hands a
replica's endpoint and incarnation to the target worker with each request routed there
(SubmitRequest.drafter); the target streams its draft rounds to the replica itself.

Leases: ``DrafterRouting.begin`` (after the target's lease, once per attempt) picks the replica
through the drafter policy (router/policies/drafter.py) and counts the request on it until ``end``;
``routed_since_report`` spreads a burst between two polls, as for workers.

Single event loop: every method runs on the router's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from protos.duet.worker.v1 import worker_pb2
from router.policies.base import RouteRequest, WorkerState
from router.policies.drafter import DrafterPolicy, DrafterState

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DrafterLease:
    """One attempt's use of one drafter replica: what the target is handed, and the count to undo."""

    drafter_id: str
    target_id: str
    ref: worker_pb2.DrafterRef
    _member: _Drafter | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Drafter:
    drafter_id: str
    endpoint: str
    channel: grpc.aio.Channel
    state: DrafterState
    stub: drafter_pb2_grpc.DrafterStub = field(init=False)
    failures: int = 0
    last_error: str = ""
    draining: bool = False
    poll_task: asyncio.Task[None] | None = None
    targets: Counter[str] = field(default_factory=Counter)  # target worker id -> requests drafting here
    report: drafter_pb2.DrafterLoad | None = None

    def __post_init__(self) -> None:
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)


class DrafterDirectory:
    def __init__(self, *, poll_interval_s: float = 0.5, poll_timeout_s: float = 2.0, failure_threshold: int = 3) -> None:
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.failure_threshold = failure_threshold
        self._members: dict[str, _Drafter] = {}
        self._closing: set[asyncio.Task[Any]] = set()

    def set_members(self, members: Iterable[Any]) -> None:
        """Make the replicas exactly ``members`` (router.workers.MemberInfo of role drafter; a
        draining one is kept but never picked). A changed endpoint is a leave + join."""
        wanted = {m.worker_id: m for m in members}
        for d in list(self._members.values()):
            m = wanted.get(d.drafter_id)
            if m is None or m.endpoint != d.endpoint:
                self._remove(d)
        for wid, m in wanted.items():
            found = self._members.get(wid)
            d = found if found is not None else self._add(wid, m.endpoint, m.pool or "drafter")
            if m.draining and not d.draining:
                logger.info("drafter %s is draining: no new requests draft there", wid)
            d.draining = d.draining or m.draining
            d.state = replace(d.state, pool=m.pool or "drafter", healthy=d.state.healthy and not d.draining)

    def _add(self, drafter_id: str, endpoint: str, pool: str) -> _Drafter:
        d = _Drafter(drafter_id, endpoint, grpc.aio.insecure_channel(endpoint),
                     DrafterState(drafter_id, endpoint, pool, healthy=False))
        self._members[drafter_id] = d
        d.poll_task = asyncio.create_task(self._poll_loop(d), name=f"poll-drafter-{drafter_id}")
        logger.info("drafter %s (pool %s) joined at %s", drafter_id, pool, endpoint)
        return d

    def _remove(self, d: _Drafter) -> None:
        del self._members[d.drafter_id]
        if d.poll_task is not None:
            d.poll_task.cancel()
        task = asyncio.ensure_future(d.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        logger.info("drafter %s (%s) left", d.drafter_id, d.endpoint)

    async def close(self) -> None:
        members = list(self._members.values())
        self._members.clear()
        for d in members:
            if d.poll_task is not None:
                d.poll_task.cancel()
        await asyncio.gather(*(d.poll_task for d in members if d.poll_task), return_exceptions=True)
        await asyncio.gather(*(d.channel.close() for d in members), *self._closing, return_exceptions=True)

    def snapshot(self) -> list[DrafterState]:
        return [replace(d.state, targets={t: n for t, n in d.targets.items() if n > 0}) for d in self._members.values()]

    def begin(self, drafter_id: str, target_id: str) -> DrafterLease:
        d = self._members[drafter_id]
        d.targets[target_id] += 1
        d.state = replace(d.state, in_flight=d.state.in_flight + 1, routed_since_report=d.state.routed_since_report + 1)
        ref = worker_pb2.DrafterRef(worker_id=drafter_id, endpoint=d.endpoint, incarnation=d.state.incarnation)
        return DrafterLease(drafter_id, target_id, ref, d)

    def end(self, lease: DrafterLease) -> None:
        d = lease._member
        assert d is not None
        d.targets[lease.target_id] -= 1
        if d.targets[lease.target_id] <= 0:
            del d.targets[lease.target_id]
        d.state = replace(d.state, in_flight=d.state.in_flight - 1)

    async def _poll_loop(self, d: _Drafter) -> None:
        while True:
            try:
                await self._poll_once(d)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: keep polling rather than freezing this replica's state
                logger.exception("drafter %s: poll crashed", d.drafter_id)
            await asyncio.sleep(self.poll_interval_s)

    async def _poll_once(self, d: _Drafter) -> None:
        sent = d.state.routed_since_report
        try:
            report = await d.stub.GetLoad(drafter_pb2.GetDrafterLoadRequest(), timeout=self.poll_timeout_s)
        except grpc.aio.AioRpcError as e:
            d.failures += 1
            d.last_error = f"{e.code().name}: {e.details()}"
            if d.failures >= self.failure_threshold and d.state.healthy:
                logger.warning("drafter %s (%s) marked unhealthy: %d polls failed, last %s", d.drafter_id,
                               d.endpoint, d.failures, d.last_error)
                d.state = replace(d.state, healthy=False)
            return
        if d.drafter_id not in self._members:
            return
        d.failures, d.report, d.last_error = 0, report, ""
        if not d.state.healthy and not d.draining:
            logger.info("drafter %s (%s) is healthy", d.drafter_id, d.endpoint)
        if d.state.incarnation and report.incarnation != d.state.incarnation:
            logger.info("drafter %s restarted (incarnation %s)", d.drafter_id, report.incarnation)
        d.state = replace(d.state, healthy=not d.draining, incarnation=report.incarnation,
                          num_requests=report.num_requests, num_active=report.num_active,
                          routed_since_report=max(0, d.state.routed_since_report - sent))

    def describe(self) -> list[dict[str, object]]:
        return [{"drafter_id": d.drafter_id, "endpoint": d.endpoint, "pool": d.state.pool, "healthy": d.state.healthy,
                 "draining": d.draining, "in_flight": d.state.in_flight, "load": d.state.load, "targets": sorted(d.targets),
                 "last_error": d.last_error} for d in self._members.values()]

    def load_reports(self) -> list[tuple[str, str, drafter_pb2.DrafterLoad]]:
        """(drafter id, pool, latest DrafterLoad) of every replica polled at least once (metrics)."""
        return [(d.drafter_id, d.state.pool, d.report) for d in self._members.values() if d.report is not None]


class DrafterRouting:
    """The pipeline's one call per attempt: which replica a request drafts on (or none)."""

    def __init__(self, directory: DrafterDirectory, policy: DrafterPolicy) -> None:
        self.directory = directory
        self.policy = policy

    def begin(self, route: RouteRequest, target: WorkerState, speculate: bool) -> DrafterLease | None:
        """A lease on the replica for ``route`` on ``target``; None when the target's pool names no
        drafter pool, the request opted out (``speculate`` False) or no replica is healthy."""
        if not target.drafter_pool or not speculate:
            return None
        drafter_id = self.policy.select(route, target, self.directory.snapshot())
        return None if drafter_id is None else self.directory.begin(drafter_id, target.worker_id)

    def end(self, lease: DrafterLease | None) -> None:
        if lease is not None:
            self.directory.end(lease)

    def counters(self) -> dict[str, int]:
        return self.policy.counters()
