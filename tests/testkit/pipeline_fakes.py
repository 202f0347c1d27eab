"""An in-memory stand-in for the router's worker side, to drive router/pipeline.py without a gRPC
server or channel (the ``fake_pipeline`` fixture in tests/router/conftest.py builds on it).

``FakeDirectory`` is what the pipeline uses of router.workers.WorkerDirectory (snapshot, begin,
end, report_stream_failure), in memory. Each ``FakeWorker``'s Submit returns a ``FakeCall`` that
replays a script one id per message, continuing where the prompt leaves off like a greedy model
(so a resumed request continues exactly), and misbehaves on cue (``FakeWorker.misbehave``, the
fields of ``Cue``). A reported worker stays unhealthy until the test heals it
(``directory.unhealthy.discard(id)``); ``declare_dead`` does what failing polls do (fail the
worker's leases and cancel their calls).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from protos.duet.worker.v1 import worker_pb2
from router.drafters import DrafterDirectory
from router.policies import RouteRequest, WorkerState
from router.workers import WorkerLease

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@dataclass
class Cue:
    """How a fake worker misbehaves (counts are tokens this call streamed so far)."""

    fail: tuple[grpc.StatusCode, str] | None = None  # end the call with this status ...
    fail_after: int = 0  # ... after this many tokens
    end_after: int | None = None  # end the stream without a finish reason
    declare_dead: tuple[int, str] | None = None  # (n, worker id): after n tokens the directory declares it dead
    bad_prefill: set[str] = field(default_factory=set)  # ABORTED when remote_prefill names one
    vanished_prefill: set[str] = field(default_factory=set)  # ... or stall until the directory declares it dead
    hang_after: int | None = None  # stop streaming until cancelled
    # (n, target id, reported count): after n tokens the worker hands the request to the target (live
    # migration): its last message carries migrated_to with num_output_tokens = reported count (n if None)
    migrate_after: tuple[int, str, int | None] | None = None


class FakeCall:
    """A Submit call: an async iterator of SubmitResponses; ``cancel`` makes the reader raise
    CancelledError, as a grpc.aio call does."""

    def __init__(self, worker: FakeWorker, request: worker_pb2.SubmitRequest) -> None:
        self.worker, self.request = worker, request
        self._cancelled = asyncio.Event()
        self._done = False
        self._stream = self._run()

    def __aiter__(self):
        return self._stream

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        self._cancelled.set()
        self.worker.cancelled.append(self.request.request_id)
        return True

    async def _run(self):
        w, cue, request = self.worker, self.worker.cue, self.request
        prefill = request.remote_prefill.worker_id if request.HasField("remote_prefill") else None
        try:
            if prefill in cue.bad_prefill:
                raise rpc_error(Code.ABORTED, f"remote prefill failed: {prefill}")
            if prefill in cue.vanished_prefill:
                w.directory.declare_dead(prefill, f"worker {prefill} stopped answering")
            start = w.offset(list(request.prompt_token_ids))
            end = min(start + request.sampling.max_tokens, len(w.script))
            i = start
            while i < end:
                k = i - start
                if cue.fail is not None and k >= cue.fail_after:
                    raise rpc_error(*cue.fail)
                if cue.end_after is not None and k >= cue.end_after:
                    return
                if cue.migrate_after is not None and k == cue.migrate_after[0]:
                    n, target, reported = cue.migrate_after
                    self._done = True
                    yield worker_pb2.SubmitResponse(migrated_to=worker_pb2.MigratedTo(
                        worker_id=target, endpoint=f"{target}:1", migration_id=f"mig/{request.request_id}",
                        num_output_tokens=n if reported is None else reported))
                    return
                if cue.declare_dead is not None and k == cue.declare_dead[0]:
                    w.directory.declare_dead(cue.declare_dead[1], f"worker {cue.declare_dead[1]} stopped answering")
                if (cue.hang_after is not None and k >= cue.hang_after) or prefill in cue.vanished_prefill:
                    await self._cancelled.wait()
                if self._cancelled.is_set():
                    raise asyncio.CancelledError
                i += 1
                response = worker_pb2.SubmitResponse(token_ids=[w.script[i - 1]])
                if i == end:
                    eos = w.script[i - 1] == w.script[-1]
                    response.finish_reason = worker_pb2.FINISH_REASON_STOP if eos else worker_pb2.FINISH_REASON_LENGTH
                    self._done = True  # the worker's last message ends the call
                yield response
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancel()  # as grpc.aio does when the reading task is cancelled
            raise
        finally:
            self._done = True


class FakeWorker:
    """A worker's stub: records each Submit (request, timeout) and the calls cancelled."""

    def __init__(self, worker_id: str, role: str, script: list[int], directory: FakeDirectory) -> None:
        self.worker_id, self.role, self.script, self.directory = worker_id, role, script, directory
        self.cue = Cue()
        self.submitted: list[worker_pb2.SubmitRequest] = []
        self.timeouts: list[float | None] = []
        self.cancelled: list[str] = []
        self.calls: list[FakeCall] = []

    def misbehave(self, **cue: object) -> None:
        """Set this worker's cue (the fields of ``Cue``), e.g. ``misbehave(end_after=5)``."""
        self.cue = Cue(**cue)  # type: ignore[arg-type]

    def offset(self, prompt: list[int]) -> int:
        """The largest k such that the prompt ends with script[:k] (where to continue)."""
        return next((k for k in range(min(len(prompt), len(self.script)), 0, -1) if prompt[-k:] == self.script[:k]), 0)

    def Submit(self, request: worker_pb2.SubmitRequest, timeout: float | None = None) -> FakeCall:
        self.submitted.append(request)
        self.timeouts.append(timeout)
        self.calls.append(FakeCall(self, request))
        return self.calls[-1]


@dataclass(eq=False)
class FakeLease(WorkerLease):
    fake_state: WorkerState | None = None

    @property
    def state(self) -> WorkerState:
        assert self.fake_state is not None
        return self.fake_state

    @property
    def pool(self) -> str:
        return self.state.role


class FakeDirectory:
    """What the pipeline uses of router.workers.WorkerDirectory, in memory. A reported worker is
    unhealthy until the test heals it; ``declare_dead`` does what failing polls do (fail the
    worker's leases and cancel their calls)."""

    def __init__(self, script: list[int], roles: dict[str, str]) -> None:
        self.workers = {wid: FakeWorker(wid, role, script, self) for wid, role in roles.items()}
        self.unhealthy: set[str] = set()
        self.incarnations = {wid: f"inc-{wid}" for wid in roles}
        self.leases: set[FakeLease] = set()
        self.reported: list[tuple[str, str]] = []
        self.num_stream_failures = 0
        self.drafters = DrafterDirectory()  # the real one, empty: these workers' pools draft on no drafter pool

    def snapshot(self) -> list[WorkerState]:
        return [self._state(wid) for wid in self.workers]

    def _state(self, wid: str) -> WorkerState:
        return WorkerState(wid, f"{wid}:1", healthy=wid not in self.unhealthy, role=self.workers[wid].role,
                           incarnation=self.incarnations[wid])

    def restart(self, worker_id: str) -> None:
        """What Ray restarting the worker looks like: a new incarnation (same endpoint here), healthy
        again, its failure cue gone."""
        self.incarnations[worker_id] += "+"
        self.unhealthy.discard(worker_id)
        self.workers[worker_id].misbehave()

    def begin(self, worker_id: str, request: RouteRequest) -> FakeLease:
        lease = FakeLease(worker_id, self.workers[worker_id], request.cost_tokens, fake_state=self._state(worker_id))
        self.leases.add(lease)
        return lease

    def end(self, lease: FakeLease) -> None:
        self.leases.remove(lease)

    def report_stream_failure(self, lease: WorkerLease, reason: str) -> None:
        self.num_stream_failures += 1
        self.reported.append((lease.worker_id, reason))
        self.unhealthy.add(lease.worker_id)

    def declare_dead(self, worker_id: str, reason: str) -> None:
        self.unhealthy.add(worker_id)
        for lease in list(self.leases):
            if lease.worker_id == worker_id and lease.failure is None:
                lease.failure = reason
                if lease.call is not None:
                    lease.call.cancel()

    def describe(self) -> list[dict[str, object]]:
        return [{"worker_id": wid, "healthy": wid not in self.unhealthy} for wid in self.workers]
