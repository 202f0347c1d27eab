"""Drain a worker by live migration: move every request it is streaming to other workers of its
pool, so it can stop in seconds instead of after its longest generation (or its drain grace).

Rounds, until nothing is left or ``timeout_s`` passes: ask every target for its load (GetLoad),
then migrate each request still here that is decoding to the target with the most free KV blocks
after what this round already sent it (up to ``MAX_CONCURRENT`` migrations at once; each pauses only
its own request). All of a round's requests are asked to pause together, so they pause at the
same step boundary and the engine calls that follow (reading their KV) wait for no step. A request still in prefill is refused with FAILED_PRECONDITION and simply tried
again next round; a target that fails (full, unreachable, refusing) is skipped for the rest of
the round. A request that cannot move stays here and keeps decoding: the caller then stops the
worker with its grace, and whatever is still left ends UNAVAILABLE, which the router resumes by
recompute. Nothing is lost either way.

Worked example (what ``WorkerServer.stop(grace, migrate_to=...)`` does)::

    result = await drain(migrator, lambda: set(servicer_inflight), targets, timeout_s=30)
    # DrainResponse(migrated=8, failed=0, remaining=0, seconds=0.4)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from protos.duet.worker.v1 import worker_pb2
from workers.handoff.migration_service import MigrationFailed, Migrator

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 16
ROUND_PAUSE_S = 0.05  # between rounds (requests still in prefill get a step or two)


async def _free_blocks(migrator: Migrator, targets: list[worker_pb2.MigrationTarget]) -> dict[str, float]:
    """worker id -> free KV blocks now (-1 for a target that does not answer: tried last)."""
    async def one(t: worker_pb2.MigrationTarget) -> float:
        try:
            r = await migrator.stub(t.endpoint).GetLoad(worker_pb2.GetLoadRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return -1.0
        return float(r.kv_blocks_total - r.kv_blocks_used) if not r.draining else -1.0
    loads = await asyncio.gather(*(one(t) for t in targets))
    return {t.worker_id: f for t, f in zip(targets, loads)}


async def drain(migrator: Migrator, inflight: Callable[[], set[str]], targets: list[worker_pb2.MigrationTarget],
                timeout_s: float) -> worker_pb2.DrainResponse:
    """Migrate every request in ``inflight()`` (re-read each round) away; see the module docstring."""
    start = time.monotonic()
    deadline = start + timeout_s
    targets = [t for t in targets if t.worker_id != migrator.worker_id]
    migrated = failed = 0
    gate = asyncio.Semaphore(MAX_CONCURRENT)
    while inflight() and targets and time.monotonic() < deadline:
        free = await _free_blocks(migrator, targets)
        skip: set[str] = set()
        sent: dict[str, int] = {t.worker_id: 0 for t in targets}

        def pick() -> worker_pb2.MigrationTarget | None:
            usable = [t for t in targets if t.worker_id not in skip and free[t.worker_id] >= 0]  # noqa: B023 - called in this iteration
            return max(usable, key=lambda t: free[t.worker_id] - sent[t.worker_id], default=None)  # noqa: B023 - called in this iteration

        async def move(rid: str) -> str:
            async with gate:
                target = pick()
                if target is None or time.monotonic() >= deadline:
                    return "skipped"
                sent[target.worker_id] += 1  # noqa: B023 - called in this iteration
                try:
                    await asyncio.wait_for(migrator.migrate(rid, target), max(deadline - time.monotonic(), 0.1))
                    return "migrated"
                except MigrationFailed as e:
                    if e.code in (grpc.StatusCode.NOT_FOUND,):
                        return "gone"  # it finished meanwhile
                    if e.code == grpc.StatusCode.FAILED_PRECONDITION and "not decoding" in str(e):
                        return "later"  # still in prefill
                    skip.add(target.worker_id)  # noqa: B023 - called in this iteration
                    logger.warning("drain: %s -> %s failed: %s", rid, target.worker_id, e)
                    return "failed"
                except TimeoutError:
                    return "failed"

        results = await asyncio.gather(*(move(rid) for rid in sorted(inflight())
                                         if not migrator.is_migrating(rid)))
        migrated += results.count("migrated")
        failed += results.count("failed")
        if inflight():
            await asyncio.sleep(ROUND_PAUSE_S)
    remaining = len(inflight())
    seconds = time.monotonic() - start
    logger.info("drain of %s: %d migrated, %d failed attempts, %d left, %.2f s", migrator.worker_id, migrated, failed,
                remaining, seconds)
    return worker_pb2.DrainResponse(migrated=migrated, failed=failed, remaining=remaining, seconds=seconds)
