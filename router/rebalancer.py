"""Rebalancer: move running requests from the hottest decode worker to the coolest by live KV
migration (workers/handoff/migration_service.py), when their load diverges. Off by default
(``RouterConfig.rebalance``).

Policy (``plan``, pure: load numbers in, moves out). Per worker: KV usage u = blocks used / total
(from its LoadReport) and, when known, TPOT t (seconds per output token of its streams, an EWMA the
router measures). Among workers of one pool that are healthy and not draining, hot = highest u,
cool = lowest u. Trigger: u_hot - u_cool > ``kv_gap``, or t_hot / t_cool > ``tpot_ratio`` (both
with some traffic). Then move ONE request, the one whose size s (in KV fraction of the hot worker:
its tokens / tokens the hot worker holds) brings the two closest to equal without crossing:
u_hot - s >= u_cool + s' (s' = its size on the cool worker). Hysteresis, so nothing bounces:
  * a moved request is not moved again for ``request_cooldown_s``;
  * after a move, the pair (hot, cool) is left alone for ``pair_cooldown_s`` (their reports
    must first show the move);
  * the move must not invert the order (the cool worker never ends hotter than the hot one), so
    the same two workers cannot trade a request back and forth on the same numbers.

Worked example: w0 u=0.90 (requests a: 400 tokens, b: 200), w1 u=0.20, both 1,000-token caches,
kv_gap 0.3: gap 0.70 > 0.3; moving a (0.40) -> w0 0.50, w1 0.60: crosses; b (0.20) -> 0.70 / 0.40:
the move. Next round (reports updated) gap 0.30: not above kv_gap: stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from protos.duet.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceSettings:
    """The policy's thresholds (RouterConfig.rebalance_* fields)."""

    kv_gap: float = 0.3
    tpot_ratio: float = 2.0
    request_cooldown_s: float = 30.0
    pair_cooldown_s: float = 5.0
    min_running: int = 2  # the hot worker runs at least this many requests (moving its only one helps nobody)


@dataclass(frozen=True)
class WorkerLoad:
    """What the policy knows of one worker. requests: (request id, tokens it holds), running here."""

    worker_id: str
    pool: str
    kv_used: int
    kv_total: int
    block_size: int
    tpot_s: float | None = None
    requests: tuple[tuple[str, int], ...] = ()

    @property
    def usage(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0


@dataclass(frozen=True)
class Move:
    request_id: str
    source: str
    target: str
    reason: str


@dataclass
class RebalanceState:
    """Hysteresis memory: when each request and each (source, target) pair last moved."""

    moved_requests: dict[str, float] = field(default_factory=dict)
    moved_pairs: dict[tuple[str, str], float] = field(default_factory=dict)

    def record(self, move: Move, now: float) -> None:
        self.moved_requests[move.request_id] = now
        self.moved_pairs[(move.source, move.target)] = now


def plan(workers: Sequence[WorkerLoad], settings: RebalanceSettings, state: RebalanceState, now: float) -> list[Move]:
    """At most one move per pool (see the module docstring)."""
    moves = []
    pools: dict[str, list[WorkerLoad]] = {}
    for w in workers:
        if w.kv_total > 0:
            pools.setdefault(w.pool, []).append(w)
    for members in pools.values():
        if len(members) < 2:
            continue
        move = _plan_pool(members, settings, state, now)
        if move is not None:
            moves.append(move)
    return moves


def _plan_pool(members: list[WorkerLoad], s: RebalanceSettings, state: RebalanceState, now: float) -> Move | None:
    hot = max(members, key=lambda w: (w.usage, w.tpot_s or 0.0))
    cool = min(members, key=lambda w: (w.usage, w.tpot_s or 0.0))
    if hot is cool or len(hot.requests) < s.min_running:
        return None
    gap = hot.usage - cool.usage
    slow = (hot.tpot_s is not None and cool.tpot_s is not None and cool.tpot_s > 0
            and hot.tpot_s / cool.tpot_s > s.tpot_ratio)
    if gap <= s.kv_gap and not slow:
        return None
    if now - state.moved_pairs.get((hot.worker_id, cool.worker_id), -1e18) < s.pair_cooldown_s:
        return None
    best: tuple[float, str] | None = None
    for rid, tokens in hot.requests:
        if now - state.moved_requests.get(rid, -1e18) < s.request_cooldown_s:
            continue
        blocks = -(-tokens // max(hot.block_size, 1))
        after_hot = (hot.kv_used - blocks) / hot.kv_total
        after_cool = (cool.kv_used + blocks) / cool.kv_total
        if cool.kv_total - cool.kv_used < blocks or after_cool > after_hot:
            continue  # no room, or it would only swap who is hot (the bounce hysteresis forbids)
        residual = after_hot - after_cool
        if best is None or residual < best[0]:
            best = (residual, rid)
    if best is None:
        return None
    reason = (f"KV usage {hot.usage:.0%} vs {cool.usage:.0%}" if gap > s.kv_gap else
              f"TPOT {(hot.tpot_s or 0.0) * 1e3:.1f} ms vs {(cool.tpot_s or 0.0) * 1e3:.1f} ms")  # slow: both set
    return Move(best[1], hot.worker_id, cool.worker_id, reason)


class Rebalancer:
    """Runs ``plan`` every ``interval_s`` over the router's worker directory and asks each move's
    source worker to Migrate (the request's stream then follows it: router/pipeline.py)."""

    def __init__(self, directory, settings: RebalanceSettings, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.settings = settings
        self.interval_s = interval_s
        self.state = RebalanceState()
        self.clock = clock
        self.counts = {"rebalance_moves": 0, "rebalance_failures": 0}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except Exception:  # a bug: log it and keep going (rebalancing is an optimisation)
                logger.exception("rebalancer round failed")

    async def round(self) -> list[Move]:
        """One planning round; executes its moves. Returns the moves that succeeded."""
        now = self.clock()
        moves = plan(self.directory.rebalance_view(), self.settings, self.state, now)
        done = []
        for move in moves:
            self.state.record(move, now)  # also on failure: do not retry the same request at once
            try:
                await self.directory.stub_of(move.source).Migrate(worker_pb2.MigrateRequest(
                    request_id=move.request_id, target=self.directory.migration_target(move.target)), timeout=30.0)
            except grpc.aio.AioRpcError as e:
                self.counts["rebalance_failures"] += 1
                logger.info("rebalance %s %s -> %s not done: %s: %s", move.request_id, move.source, move.target,
                            e.code().name, e.details())
                continue
            self.counts["rebalance_moves"] += 1
            logger.info("rebalanced %s from %s to %s (%s)", move.request_id, move.source, move.target, move.reason)
            done.append(move)
        return done
