"""WorkerDirectory: the router's view of its worker pool (membership, channels, load, health).

Terms:
    member      a (worker_id, endpoint[, role[, pool[, draining[, drafter_pool[, model]]]]]) entry
                (``MemberInfo``; model: the served model, "" = the router's default) pushed by
                whoever knows the pool: a static list, or the cluster controller on every join,
                leave or drain (``set_members``; no router restart).
    pool        the worker's pool name (``decode``), the label of its metrics; default its role.
    draining    the autoscaler is removing the worker: it stays a member (its streams finish, its
                polling goes on, status shows it) but is never routable; then it leaves the list.
    drafter     a member with role "drafter" is a drafter replica, not a worker: ``set_members``
                hands those to ``drafters`` (router/drafters.py); a worker's ``drafter_pool`` names
                the pool its speculative requests draft on.
    poll        GetLoad + grpc.health.v1 Check("duet.worker.v1.Worker"), sent together right after
                a worker joins and then every ``poll_interval_s``.
    lease       one request's use of one worker, from ``begin`` (after the policy chose it) to
                ``end`` (the stream is over, any way). Leases carry the router-side counters.
    healthy     routable: the latest poll succeeded and said SERVING, fewer than
                ``failure_threshold`` polls have failed in a row since, and no stream has failed on
                it within ``stream_failure_cooldown_s``. A new member is unhealthy until its first
                poll succeeds.

What the directory does for the policies (see router/policies/base.py): after ``select`` the
pipeline calls ``begin`` (in_flight += 1, routed_since_report += 1 / += cost tokens), ``end``
when the stream is over (in_flight -= 1); a LoadReport replaces the reported numbers and resets
the routed-since-report counters (less whatever was routed while that GetLoad was in flight,
which the report may not include yet).

Failure handling: ``failure_threshold`` polls failing in a row mark a worker unhealthy *and*
cancel its in-flight streams (the pipeline ends them with UNAVAILABLE): a worker whose node
vanished without closing its connections would otherwise leave those streams hanging. A worker
that answers NOT_SERVING (draining) is only taken out of routing; its streams finish. A member
that leaves keeps its channel until its last lease ends, so leaving never cuts a stream short.

Requests travel on one SubmitStream per worker (router/submit_mux.py: the worker batches a step's
output of all of them into one message), or with ``multiplex=False`` as one Submit call each.

Single event loop: every method runs on the router's loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.drafters import DrafterDirectory
from router.policies import RouteRequest, WorkerState
from router.block_watch import BlockWatch
from router.prefix_index import BlockReport, PrefixIndex
from router.submit_mux import StreamCall, SubmitMux

logger = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")
DRAFTER = "drafter"  # a member role that is no worker (router/drafters.py)
WORKER_HEALTH_SERVICE = "duet.worker.v1.Worker"
# Reconnect quickly to a worker that comes back (gRPC's default backoff grows to 120 s).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class MemberInfo(NamedTuple):
    """One member as pushed to the directory; plain (worker_id, endpoint[, role]) tuples also work."""

    worker_id: str
    endpoint: str
    role: str = "colocated"
    pool: str = ""  # "" = the role
    draining: bool = False
    drafter_pool: str = ""  # the drafter pool this worker's speculative requests draft on ("" = none)
    model: str = ""  # the served model (its pool's); "" = the router's default model


@dataclass(eq=False)
class WorkerLease:
    """One request's use of one worker. ``call`` is set by the pipeline once the Submit call
    exists; ``failure`` is set (and the call cancelled) if the directory declares the worker dead
    while the lease is held."""

    worker_id: str
    stub: worker_pb2_grpc.WorkerStub
    cost_tokens: int
    call: StreamCall | None = None
    failure: str | None = None
    _member: _Member | None = field(default=None, repr=False)
    request_id: str = ""  # the worker-side request id (the router's internal id)
    tokens: int = 0  # prompt + tokens streamed on this lease: what the worker's KV holds (rebalancer)
    last_chunk: float = 0.0  # time.monotonic() of the latest chunk (TPOT)

    def submit(self, request: worker_pb2.SubmitRequest, timeout: float | None) -> StreamCall:
        """Send the request to the worker: on its SubmitStream (router/submit_mux.py) once its load
        report said it serves one, else (an older worker, or a directory that does not multiplex)
        as a Submit call of its own."""
        m = self._member
        if m is not None and m.mux is not None and m.report is not None and m.report.submit_stream:
            return m.mux.submit(request, timeout)
        return self.stub.Submit(request, timeout=timeout)

    def observe_chunk(self, num_tokens: int, now: float) -> None:
        """A chunk of ``num_tokens`` arrived: count its tokens, and feed the worker's TPOT estimate
        (an EWMA of seconds per token between chunks; the rebalancer compares it across workers)."""
        self.tokens += num_tokens
        m = self._member
        if m is not None and self.last_chunk and num_tokens:
            per_token = (now - self.last_chunk) / num_tokens
            m.tpot_s = per_token if m.tpot_s is None else 0.8 * m.tpot_s + 0.2 * per_token
        self.last_chunk = now

    @property
    def state(self) -> WorkerState:
        """The worker's current state (endpoint, incarnation, load) as the directory sees it."""
        assert self._member is not None
        return self._member.state

    @property
    def pool(self) -> str:
        """The worker's pool (the label of its metrics)."""
        assert self._member is not None
        return self._member.pool


@dataclass(eq=False)
class _Member:
    worker_id: str
    endpoint: str
    channel: grpc.aio.Channel
    state: WorkerState
    stub: worker_pb2_grpc.WorkerStub = field(init=False)
    health_stub: health_pb2_grpc.HealthStub = field(init=False)
    failures: int = 0  # consecutive failed polls
    cooldown_until: float = 0.0  # monotonic; no re-admission before (after a stream failure)
    last_error: str = ""
    leases: set[WorkerLease] = field(default_factory=set)
    poll_task: asyncio.Task[None] | None = None
    block_watch: BlockWatch | None = None  # the pushed block events (router/block_watch.py)
    first_poll: asyncio.Event = field(default_factory=asyncio.Event)
    removed: bool = False
    warned: set[str] = field(default_factory=set)
    pool: str = ""
    draining: bool = False
    report: worker_pb2.LoadReport | None = None  # the latest, for the metrics exporter
    tpot_s: float | None = None  # EWMA of seconds per output token of its streams (WorkerLease.observe_chunk)
    multiplex: bool = True
    mux: SubmitMux | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        if self.multiplex:
            self.mux = SubmitMux(self.stub)


class WorkerDirectory:
    def __init__(self, *, poll_interval_s: float = 0.2, poll_timeout_s: float = 2.0, failure_threshold: int = 3,
                 stream_failure_cooldown_s: float = 1.0,
                 on_health_change: Callable[[bool], None] | None = None,
                 prefix_index: PrefixIndex | None = None, watch_blocks: bool = True,
                 multiplex: bool = True) -> None:
        self.poll_interval_s = poll_interval_s
        self.multiplex = multiplex  # requests to a worker share one SubmitStream (router/submit_mux.py)
        self.poll_timeout_s = poll_timeout_s
        self.failure_threshold = failure_threshold
        self.stream_failure_cooldown_s = stream_failure_cooldown_s
        self.on_health_change = on_health_change
        self.prefix_index = prefix_index  # fed from every poll's block events (router/prefix_index.py)
        # ... or, where the worker pushes them, from its WatchBlocks stream (router/block_watch.py)
        self.watch_blocks = watch_blocks and prefix_index is not None
        self.num_block_watch_unsupported = 0
        self._members: dict[str, _Member] = {}
        self._any_healthy = False
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()  # strong refs to fire-and-forget tasks
        self.drafters = DrafterDirectory(poll_interval_s=poll_interval_s, poll_timeout_s=poll_timeout_s,
                                         failure_threshold=failure_threshold)
        self.num_stream_failures = 0
        self.num_unhealthy_transitions = 0

    # ------------------------------------------------------------- membership
    async def set_members(self, members: Iterable[tuple[Any, ...]], *, wait: bool = True) -> None:
        """Make the pool exactly ``members``: ``MemberInfo`` entries or plain (worker_id, endpoint)
        pairs / (worker_id, endpoint, role) triples (role: colocated, prefill or decode; default
        colocated). Newcomers are polled at once; with ``wait`` this returns after their first poll
        (bounded by the poll timeout), so a healthy newcomer is routable when it returns. A changed
        endpoint is a leave + join; a member marked draining stops being routable at once."""
        assert not self._closed, "set_members after close()"
        wanted: dict[str, str] = {}
        roles: dict[str, str] = {}
        infos: dict[str, MemberInfo] = {}
        drafters = []
        for member in members:
            info = MemberInfo(*member)
            if info.role == DRAFTER:
                drafters.append(info._replace(pool=info.pool or DRAFTER))
                continue
            worker_id, endpoint = info.worker_id, info.endpoint
            roles[worker_id] = info.role or "colocated"
            infos[worker_id] = info._replace(role=roles[worker_id], pool=info.pool or roles[worker_id])
            if roles[worker_id] not in ROLES:
                raise ValueError(f"member {worker_id!r}: role {roles[worker_id]!r} must be one of {', '.join(ROLES)}")
            if not isinstance(worker_id, str) or not worker_id or not isinstance(endpoint, str) or not endpoint:
                raise ValueError(f"member ({worker_id!r}, {endpoint!r}): worker id and endpoint must be "
                                 "non-empty strings")
            if wanted.setdefault(worker_id, endpoint) != endpoint:
                raise ValueError(f"worker id {worker_id!r} listed twice with different endpoints "
                                 f"({wanted[worker_id]!r}, {endpoint!r})")
        self.drafters.set_members(drafters)
        for m in list(self._members.values()):
            if wanted.get(m.worker_id) != m.endpoint:
                self._remove(m)
            elif m.state.role != roles[m.worker_id]:
                m.state = replace(m.state, role=roles[m.worker_id])
        joined = [self._add(wid, ep, roles[wid]) for wid, ep in wanted.items() if wid not in self._members]
        for m in self._members.values():
            m.pool = infos[m.worker_id].pool
            if m.state.drafter_pool != infos[m.worker_id].drafter_pool:
                m.state = replace(m.state, drafter_pool=infos[m.worker_id].drafter_pool)
            if m.state.model != infos[m.worker_id].model:
                m.state = replace(m.state, model=infos[m.worker_id].model)
            if infos[m.worker_id].draining and not m.draining:
                m.draining = True
                logger.info("worker %s (%s) is draining: no new requests; %d still streaming",
                            m.worker_id, m.endpoint, len(m.leases))
                self._set_healthy(m, False, "draining")
        self._notify_health()
        if wait and joined:
            waits = [asyncio.ensure_future(m.first_poll.wait()) for m in joined]
            _, pending = await asyncio.wait(waits, timeout=self.poll_timeout_s + 0.5)
            for w in pending:
                w.cancel()

    def _add(self, worker_id: str, endpoint: str, role: str = "colocated") -> _Member:
        channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        m = _Member(worker_id, endpoint, channel, WorkerState(worker_id, endpoint, healthy=False, role=role),
                    multiplex=self.multiplex)
        self._members[worker_id] = m
        m.poll_task = asyncio.create_task(self._poll_loop(m), name=f"poll-{worker_id}")
        if self.watch_blocks:
            assert self.prefix_index is not None
            m.block_watch = BlockWatch(worker_id, m.stub, self.prefix_index, retry_s=self.poll_interval_s,
                                       incarnation=lambda: m.state.incarnation, on_unsupported=self._watch_unsupported)
            m.block_watch.start()
        logger.info("worker %s joined at %s", worker_id, endpoint)
        return m

    def _remove(self, m: _Member) -> None:
        m.removed = True
        del self._members[m.worker_id]
        if m.poll_task is not None:
            m.poll_task.cancel()
        if m.block_watch is not None:
            m.block_watch.stop()
        m.state = replace(m.state, healthy=False)
        if self.prefix_index is not None:
            self.prefix_index.forget(m.worker_id)
        logger.info("worker %s (%s) left the pool (%d requests still streaming from it)",
                    m.worker_id, m.endpoint, len(m.leases))
        if not m.leases:
            self._spawn(m.channel.close())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Stop polling and close every channel (cancelling any call still open)."""
        self._closed = True
        members = list(self._members.values())
        self._members.clear()
        for m in members:
            if m.poll_task is not None:
                m.poll_task.cancel()
        watches = [m.block_watch.stop() for m in members if m.block_watch is not None]
        await asyncio.gather(*(m.poll_task for m in members if m.poll_task), *(t for t in watches if t),
                             return_exceptions=True)
        await asyncio.gather(*(m.channel.close() for m in members), *self._background, return_exceptions=True)
        await self.drafters.close()
        self._notify_health()

    # ------------------------------------------------------------- routing
    def snapshot(self) -> list[WorkerState]:
        """Every member's current state (healthy or not): what a policy's ``select`` takes."""
        return [m.state for m in self._members.values()]

    def open_stream_requests(self) -> int:
        """Requests waiting on the workers' SubmitStreams now (router/submit_mux.py)."""
        return sum(m.mux.open_requests for m in self._members.values() if m.mux is not None)

    def any_healthy(self) -> bool:
        return any(m.state.healthy for m in self._members.values())

    def begin(self, worker_id: str, request: RouteRequest) -> WorkerLease:
        """Start a lease on ``worker_id`` (just returned by the policy from ``snapshot()``)."""
        m = self._members[worker_id]
        cost = request.cost_tokens
        lease = WorkerLease(worker_id, m.stub, cost, _member=m, request_id=request.request_id,
                            tokens=len(request.prompt_token_ids))
        m.leases.add(lease)
        s = m.state
        m.state = replace(s, in_flight_requests=s.in_flight_requests + 1,
                          routed_requests_since_report=s.routed_requests_since_report + 1,
                          routed_tokens_since_report=s.routed_tokens_since_report + cost)
        return lease

    def end(self, lease: WorkerLease) -> None:
        m = lease._member
        assert m is not None and lease in m.leases, "lease ended twice"
        m.leases.discard(lease)
        m.state = replace(m.state, in_flight_requests=m.state.in_flight_requests - 1)
        if m.removed and not m.leases:
            self._spawn(m.channel.close())

    def report_stream_failure(self, lease: WorkerLease, reason: str) -> None:
        """A Submit stream on this worker failed in a way that means the worker is gone or
        broken: stop routing to it until a poll succeeds after the cooldown."""
        m = lease._member
        assert m is not None
        self.num_stream_failures += 1
        m.cooldown_until = time.monotonic() + self.stream_failure_cooldown_s
        m.last_error = reason
        if not m.removed:
            self._set_healthy(m, False, f"stream failed: {reason}")

    # ------------------------------------------------------------- polling
    async def _poll_loop(self, m: _Member) -> None:
        while True:
            try:
                await self._poll_once(m)
            except Exception:  # a bug: keep polling rather than silently freezing this worker's state
                logger.exception("worker %s: poll crashed", m.worker_id)
            m.first_poll.set()
            await asyncio.sleep(self.poll_interval_s)

    async def _poll_once(self, m: _Member) -> None:
        sent_requests = m.state.routed_requests_since_report
        sent_tokens = m.state.routed_tokens_since_report
        report: Any
        status: Any
        request = worker_pb2.GetLoadRequest()
        if self.prefix_index is not None and not self._watching(m):
            since, incarnation = self.prefix_index.cursor(m.worker_id, m.state.incarnation)
            request = worker_pb2.GetLoadRequest(block_events=True, block_events_since=since,
                                                block_events_incarnation=incarnation)
        report, status = await asyncio.gather(
            m.stub.GetLoad(request, timeout=self.poll_timeout_s),
            m.health_stub.Check(health_pb2.HealthCheckRequest(service=WORKER_HEALTH_SERVICE),
                                timeout=self.poll_timeout_s),
            return_exceptions=True,
        )
        if isinstance(status, grpc.aio.AioRpcError) and status.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._warn_once(m, "no-health", "worker %s serves no grpc.health.v1 service: judging its "
                            "health by GetLoad alone", m.worker_id)
            status = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        elif isinstance(status, grpc.aio.AioRpcError) and status.code() == grpc.StatusCode.NOT_FOUND:
            # The worker has not registered its service yet (still loading): alive, not ready.
            status = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        if m.removed:
            return
        if not isinstance(report, BaseException):
            m.report = report
        error = next((r for r in (report, status) if isinstance(r, BaseException)), None)
        if error is not None:
            if not isinstance(error, grpc.aio.AioRpcError):
                raise error  # a bug, not a worker failure
            m.failures += 1
            m.last_error = f"{error.code().name}: {error.details()}"
            logger.debug("worker %s poll failed (%d in a row): %s", m.worker_id, m.failures, m.last_error)
            if m.failures >= self.failure_threshold:
                self._set_healthy(m, False, f"{m.failures} polls failed, last {m.last_error}")
            if m.failures == self.failure_threshold:  # healthy or draining: its streams are stuck too
                self._fail_leases(m, f"worker {m.worker_id} stopped answering ({m.last_error})")
            return
        m.failures = 0
        if self.prefix_index is not None and report.block_events_supported and report.kv_block_size \
                and not self._watching(m):
            self.prefix_index.apply(m.worker_id, report.incarnation,
                                    BlockReport(report.block_seq, report.block_snapshot, report.blocks_stored,
                                                report.blocks_removed, report.blocks_stored_tiers),
                                    block_size=report.kv_block_size)
        if report.worker_id and report.worker_id != m.worker_id:
            self._warn_once(m, "id", "worker %s at %s reports worker_id %r; keeping the member id",
                            m.worker_id, m.endpoint, report.worker_id)
        s = m.state
        m.state = replace(
            WorkerState.from_load_report(
                report, endpoint=m.endpoint, healthy=s.healthy, in_flight_requests=s.in_flight_requests,
                routed_requests_since_report=s.routed_requests_since_report - sent_requests,
                routed_tokens_since_report=s.routed_tokens_since_report - sent_tokens),
            worker_id=m.worker_id, role=s.role, drafter_pool=s.drafter_pool, model=s.model,
        )
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
            self._set_healthy(m, False, f"health of {WORKER_HEALTH_SERVICE} is {name}")
        elif time.monotonic() >= m.cooldown_until:
            self._set_healthy(m, True, "poll succeeded")

    @staticmethod
    def _watching(m: _Member) -> bool:
        return m.block_watch is not None and m.block_watch.watching

    def _watch_unsupported(self, worker_id: str) -> None:
        self.num_block_watch_unsupported += 1

    def _fail_leases(self, m: _Member, reason: str) -> None:
        for lease in list(m.leases):
            if lease.failure is None:
                lease.failure = reason
                if lease.call is not None:
                    lease.call.cancel()

    def _set_healthy(self, m: _Member, healthy: bool, why: str) -> None:
        if healthy and m.draining:
            return  # draining is final: the member only leaves
        if m.state.healthy == healthy:
            return
        m.state = replace(m.state, healthy=healthy)
        if healthy:
            logger.info("worker %s (%s) is healthy: %s", m.worker_id, m.endpoint, why)
        else:
            self.num_unhealthy_transitions += 1
            logger.warning("worker %s (%s) marked unhealthy, not routing to it: %s", m.worker_id, m.endpoint, why)
        self._notify_health()

    def _notify_health(self) -> None:
        now = self.any_healthy()
        if now != self._any_healthy:
            self._any_healthy = now
            if self.on_health_change is not None:
                self.on_health_change(now)

    def _warn_once(self, m: _Member, key: str, msg: str, *args: object) -> None:
        if key not in m.warned:
            m.warned.add(key)
            logger.warning(msg, *args)

    # ------------------------------------------------------------- rebalancing
    def rebalance_view(self) -> list[Any]:
        """router.rebalancer.WorkerLoad of every healthy, non-draining decode or colocated member
        that has reported: its KV use, TPOT estimate and the requests streaming from it."""
        from router.rebalancer import WorkerLoad

        return [WorkerLoad(m.worker_id, m.pool, m.report.kv_blocks_used, m.report.kv_blocks_total,
                           m.report.kv_block_size or 16, m.tpot_s,
                           tuple((lease.request_id, lease.tokens) for lease in m.leases
                                 if lease.request_id and lease.tokens and lease.failure is None))
                for m in self._members.values()
                if m.report is not None and m.state.healthy and not m.draining and not m.removed
                and m.state.role != "prefill"]

    def stub_of(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        return self._members[worker_id].stub

    def migration_target(self, worker_id: str) -> worker_pb2.MigrationTarget:
        m = self._members[worker_id]
        return worker_pb2.MigrationTarget(worker_id=m.worker_id, endpoint=m.endpoint, incarnation=m.state.incarnation)

    # ------------------------------------------------------------- introspection
    def describe(self) -> list[dict[str, object]]:
        """One dict per member (for status pages and tests)."""
        return [{"worker_id": m.worker_id, "endpoint": m.endpoint, "role": m.state.role, "pool": m.pool,
                 "model": m.state.model, "adapters": sorted(m.state.adapters),
                 "healthy": m.state.healthy, "draining": m.draining,
                 "in_flight": m.state.in_flight_requests, "load_tokens": m.state.load_tokens,
                 "consecutive_poll_failures": m.failures, "last_error": m.last_error,
                 "requests": sorted(lease.request_id for lease in m.leases if lease.request_id)}
                for m in self._members.values()]

    def load_reports(self) -> list[tuple[str, str, worker_pb2.LoadReport]]:
        """(worker_id, pool, latest LoadReport) of every member polled at least once (the
        metrics exporter's source: queue depth, KV use, expert load, ...)."""
        return [(m.worker_id, m.pool, m.report) for m in self._members.values() if m.report is not None]
