"""The worker's internal gRPC service: one Engine behind ``duet.worker.v1.Worker`` and grpc health.

Threads. The asyncio loop serves RPCs; ONE engine thread (``workers.engine.loop.EngineLoop``) builds
the Engine, steps it, and is the only thread that ever touches it. The two sides meet in three places:
  inbox     RPC side -> engine thread: a deque of commands (add, abort) under a Condition. The engine
            thread drains it between steps and sleeps on the Condition when it has no work.
  sinks     engine thread -> RPC side: one ``asyncio.Queue`` per request, fed through
            ``loop.call_soon_threadsafe`` (one callback per step, carrying all of that step's outputs).
  snapshot  an immutable ``LoadSnapshot`` the engine thread publishes after every step; GetLoad
            reads it (a reference read), so GetLoad never waits for a step.

Ending a request early:
  client cancel / deadline  the Submit handler's ``finally`` posts an abort; the engine frees the
                            request's KV blocks before its next step. Nothing more is sent.
  Abort RPC                 the stream ends normally with finish_reason ABORT; found=False if unknown.
  SubmitStream              (workers/server/submit_stream.py) what the router uses: many Submits on
                            one stream, each run by the Submit handler, their output batched into one
                            message per step; a SubmitCancel or the stream's end cancels as above.
  stop(grace)               health goes NOT_SERVING and new Submits get UNAVAILABLE at once; in-flight
                            streams get ``grace`` seconds to finish, then the rest are aborted in the
                            engine and end with status UNAVAILABLE (retryable: the router may resend).
  engine failure            (a step raised) every stream ends with UNAVAILABLE, health goes
                            NOT_SERVING, and the worker refuses new work until it is restarted.

Disaggregation (workers/handoff/disagg.py): a Submit with ``remote_prefill`` reserves KV blocks here and has
the named worker prefill (the Prefill RPC, worker to worker) and send the blocks over the pair's
channel (shared memory on one host, else gloo/NCCL); every worker can serve either half. Prefix pull
(workers/handoff/prefix_pull.py): a Submit with ``prefix_source`` first pulls that prefix's KV blocks from
the worker holding them (its PullPrefix RPC) into this worker's prefix cache. GetLoad reports
transfer and pull counters.

Live migration (workers/handoff/migration_service.py, workers/handoff/drain.py): Migrate moves a running request to
another worker (its Submit stream then ends with ``migrated_to``), TakeOver is the target half, a
Submit with ``migration_id`` attaches to a request migrated here, Drain (and ``stop(grace,
migrate_to=...)``) moves every running request away. GetLoad reports migration counters.

LoRA (workers/server/adapters.py, workers/lora/): LoadAdapter / UnloadAdapter / ListAdapters manage
the engine's adapter set; a Submit or Prefill naming an adapter this worker lacks loads it from the
request's AdapterRef.source first (off the engine thread); GetLoad reports the adapters loaded.

Worked example::

    server = await start_worker_server(EngineConfig(model=str(resolve_model("SmolLM2-135M-Instruct"))), port=50061)
    async with grpc.aio.insecure_channel(server.endpoint) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.SubmitRequest(request_id="r1", prompt_token_ids=[504, 3575, 282, 4649, 314],
            sampling=worker_pb2.SamplingParams(max_tokens=8, temperature=0, top_p=1))
        async for msg in stub.Submit(request):   # one message per step: token-id deltas
            print(list(msg.token_ids))            # the last one also has finish_reason and usage
    await server.stop(grace=5)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any, NoReturn
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.config import EngineConfig
from workers.handoff.disagg import Disaggregation, PrefillRejected, RemotePrefillError
from workers.build import build_engine
from workers.engine.engine import Engine
from workers.engine.kv_handoff import KVCapacityError
from workers.engine.runner import RequestOutput
from workers.engine.loop import EngineLimits, EngineLoop, Sink, WorkerUnavailableError
from workers.errors import InvalidRequestError
from workers.kv.transfer import check_kv_backend
from workers.sample.logprobs_proto import to_proto
from workers.handoff.migration_service import MigrationFailed, Migrator
from workers.handoff.prefix_pull import PrefixPull
from workers.server.adapters import LORA_ERRORS, AdapterAdmin, lora_status
from workers.server.block_watch import watch_blocks
from workers.server.submit_stream import SubmitStreams
from workers.block_hash import adapter_root, chain_hashes
from workers.engine.block_events import PendingBlocks
from workers.sampling_params import SamplingParams
from workers.engine.proposer import DrafterRef
from workers.startup import StartupTimeline
from workers.engine.sequence import FinishReason
from workers.structured.convert import spec_from_proto

logger = logging.getLogger(__name__)

SERVICE_NAME = "duet.worker.v1.Worker"
# A failed disaggregated request frees its reserved KV blocks before its caller hears of the failure
# (so a load report read right after the error already shows them free); this bounds that wait.
RELEASE_WAIT_S = 5.0



def to_sampling_params(p: worker_pb2.SamplingParams) -> SamplingParams:
    """Proto -> engine params (every field literal; see the proto). Raises InvalidRequestError."""
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
                          stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
                          num_speculative_tokens=(p.num_speculative_tokens if p.HasField("num_speculative_tokens")
                                                  else None),
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
                          min_p=p.min_p, min_tokens=p.min_tokens, logit_bias=tuple(p.logit_bias.items()),
                          top_logprobs=p.top_logprobs if p.HasField("top_logprobs") else None,
                          structured=spec_from_proto(p.structured) if p.HasField("structured") else None)


def _merge(outputs: list[RequestOutput], migrated_to: worker_pb2.MigratedTo | None = None) -> worker_pb2.SubmitResponse:
    """Several queued step outputs of one request as one message (the last may be the final one;
    one that ended MIGRATED carries ``migrated_to`` instead of a finish reason)."""
    msg = worker_pb2.SubmitResponse(token_ids=[t for o in outputs for t in o.new_token_ids],
                                    logprobs=[to_proto(lp) for o in outputs for lp in o.new_logprobs or ()])
    last = outputs[-1]
    if last.finish_reason is FinishReason.MIGRATED:
        assert migrated_to is not None, "a migrated request's source knows where it went"
        msg.migrated_to.CopyFrom(migrated_to)
    elif last.finished:
        assert last.finish_reason is not None  # finished
        msg.finish_reason = worker_pb2.FinishReason.Value(f"FINISH_REASON_{last.finish_reason.name}")
        msg.usage.CopyFrom(worker_pb2.Usage(prompt_tokens=last.num_prompt_tokens,
                                            completion_tokens=last.num_output_tokens,
                                            cached_prompt_tokens=last.num_cached_tokens))
    return msg


def _drafter_assignment(request_id: str, d: worker_pb2.DrafterRef) -> Callable[[Engine], None]:
    """What the engine thread runs for Submit.drafter: the request drafts on that replica."""
    ref = DrafterRef(d.worker_id, d.endpoint, d.incarnation)

    def assign(engine: Engine) -> None:
        if engine.speculator is not None:
            engine.speculator.assign(request_id, ref)
    return assign


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """context.abort, typed as what it does: it raises (grpc's stubs do not say so)."""
    await context.abort(code, details)
    raise AssertionError("context.abort raises")  # pragma: no cover


def _status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    lora = lora_status(error)
    if lora is not None:
        return lora
    if isinstance(error, InvalidRequestError):
        code = grpc.StatusCode.ALREADY_EXISTS if error.field == "request_id" else grpc.StatusCode.INVALID_ARGUMENT
        # a structured-output spec that failed to compile or a grammar at a dead end (mid-stream):
        # named as the request's field, like the sampling errors _admit reports
        return code, f"sampling.{error}" if error.field.startswith("structured") else str(error)
    if isinstance(error, WorkerUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, KVCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room to reserve KV blocks: {error}"
    if isinstance(error, RemotePrefillError):
        return grpc.StatusCode.ABORTED, f"remote prefill failed: {error}"
    if isinstance(error, (PrefillRejected, MigrationFailed)):
        return error.code, str(error)
    return grpc.StatusCode.INTERNAL, f"worker error: {error!r}"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """duet.worker.v1.Worker over an EngineLoop. Runs on the asyncio loop only (no locks needed).

    max_inflight: Submits in flight at once; beyond it, RESOURCE_EXHAUSTED.
    """

    def __init__(self, engine: EngineLoop, limits: EngineLimits, worker_id: str, max_inflight: int = 1024) -> None:
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex  # new per process start: the prefix cache starts empty
        self.limits = limits
        self.max_inflight = max_inflight
        self.accepting = True  # False once draining (or the engine failed): Submit -> UNAVAILABLE
        self._engine = engine
        self._inflight: set[str] = set()  # request ids with a live Submit handler
        self.disagg: Disaggregation | None = None  # set by start_worker_server
        self.migrator: Migrator | None = None  # set by start_worker_server (with disagg)
        self.on_drain: Callable[[], Awaitable[object]] | None = None  # set by WorkerServer: health NOT_SERVING
        self.prefix_pull: PrefixPull | None = None  # set by start_worker_server (with disagg)
        self.adapter_admin = AdapterAdmin(limits.adapters)  # LoRA (workers/server/adapters.py)
        # admitted prompts not computed yet, reported as pending blocks (workers/engine/block_events.py)
        self.pending = PendingBlocks(limits.block_events) if limits.block_events is not None else None
        self.submit_streams = SubmitStreams(self.Submit)  # SubmitStream: many Submits, one message per step

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def inflight_ids(self) -> set[str]:
        return set(self._inflight)

    def _attaching(self, request: worker_pb2.SubmitRequest | worker_pb2.PrefillRequest) -> bool:
        """A Submit that attaches to a request migrated here (taken even while draining: it runs here already)."""
        return bool(getattr(request, "migration_id", "")) and self.migrator is not None and \
            self.migrator.is_parked(request.request_id)

    def _check(self, request: worker_pb2.SubmitRequest | worker_pb2.PrefillRequest) -> tuple[grpc.StatusCode, str] | None:
        rid, ids, lim = request.request_id, request.prompt_token_ids, self.limits
        if not self.accepting and not self._attaching(request):
            return grpc.StatusCode.UNAVAILABLE, "worker is draining or shutting down"
        if not rid:
            return grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty"
        if rid in self._inflight:
            return grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already in flight on this worker"
        if len(self._inflight) >= self.max_inflight:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker queue full ({self.max_inflight} requests in flight)"
        if not request.HasField("sampling"):
            return grpc.StatusCode.INVALID_ARGUMENT, "sampling: required (resolved sampling parameters)"
        if not ids:
            return grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: must not be empty"
        if len(ids) >= lim.max_model_len:
            return grpc.StatusCode.INVALID_ARGUMENT, (
                f"prompt_token_ids: {len(ids)} tokens; the limit is {lim.max_model_len - 1} "
                f"(context {lim.max_model_len} including at least one output token)")
        if max(ids) >= lim.vocab_size:
            return grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids: every id must be < {lim.vocab_size}"
        return None

    async def _admit(self, request, context: grpc.aio.ServicerContext,
                     problem: tuple[grpc.StatusCode, str] | None = None) -> SamplingParams:
        """The request's engine params; or the call is aborted with the first problem: the common
        checks, then ``problem`` (a precondition of the RPC), then bad sampling fields."""
        problem = self._check(request) or problem
        if problem is None:
            try:
                return to_sampling_params(request.sampling)
            except InvalidRequestError as e:
                problem = grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}"
        await context.abort(*problem)
        raise AssertionError("context.abort raises")  # pragma: no cover

    async def Submit(self, request: worker_pb2.SubmitRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SubmitResponse]:
        params = await self._admit(request, context)
        rid = request.request_id
        attached = self.migrator.attach(rid, request.migration_id, list(request.prompt_token_ids)) \
            if request.migration_id and self.migrator is not None else None
        sink: Sink = attached if attached is not None else asyncio.Queue()
        if request.HasField("drafter"):  # queued before the add / reserve below: its prefetch goes there too
            self._engine.call(_drafter_assignment(rid, request.drafter))
        self._inflight.add(rid)
        finished = False
        pending = self._add_pending(request) if attached is None else []
        try:
            # LoRA: load the request's adapter first if this worker lacks it (off the engine thread)
            adapter = await self.adapter_admin.ensure(request.adapter) \
                if request.HasField("adapter") and attached is None else ""
            if attached is not None:
                logger.info("request %s: attached to its migrated run here", rid)
            elif request.HasField("remote_prefill"):
                assert self.disagg is not None
                await self.disagg.decode(rid, list(request.prompt_token_ids), params, request.sampling,
                                         request.remote_prefill, sink, request.resumed_output_tokens,
                                         request.adapter if adapter else None)
            else:
                if request.HasField("prefix_source") and self.prefix_pull is not None:
                    await self.prefix_pull.pull(rid, list(request.prompt_token_ids), request.prefix_source, adapter)
                self._engine.add(rid, list(request.prompt_token_ids), params, sink,
                                 resumed_output_tokens=request.resumed_output_tokens, adapter=adapter)
            while not finished:
                items = [await sink.get()]
                while not sink.empty():  # a slow reader gets the backlog as one message
                    items.append(sink.get_nowait())
                error = next((i for i in items if isinstance(i, Exception)), None)
                if error is not None:
                    finished = True  # the engine no longer holds the request
                    await context.abort(*_status_of(error))
                finished = items[-1].finished
                if pending:  # its prompt is computed: the blocks are held (or not) for real now
                    self._release_pending(pending)
                    pending = []
                migrated = items[-1].finish_reason is FinishReason.MIGRATED
                yield _merge(items, self.migrator.migrated_to(rid) if migrated and self.migrator else None)
        except (InvalidRequestError, KVCapacityError, RemotePrefillError, PrefillRejected, *LORA_ERRORS) as e:
            # the disaggregated path's errors, and the request's adapter that could not be loaded
            logger.warning("request %s: %s", rid, e)
            finished = True
            try:  # free its blocks first, then answer
                await asyncio.wait_for(asyncio.shield(self._engine.abort(rid)), RELEASE_WAIT_S)
            except TimeoutError:
                logger.warning("request %s: the engine did not confirm the abort within %.0f s", rid, RELEASE_WAIT_S)
            await context.abort(*_status_of(e))
        finally:
            if not finished:  # cancelled, deadline, or the stream broke: free the KV blocks
                self._engine.abort(rid)
                logger.debug("request %s ended early; aborted in the engine", rid)
            self._release_pending(pending)
            self._inflight.discard(rid)

    async def SubmitStream(self, request_iterator: AsyncIterator[worker_pb2.SubmitStreamRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.SubmitStreamResponse]:
        async for batch in self.submit_streams.serve(request_iterator):
            yield batch

    def _add_pending(self, request: worker_pb2.SubmitRequest) -> list[int]:
        """Report the prompt's full blocks as pending (Tier.PENDING) from admission to its first
        token, so every router watching sees this worker computing the prefix; returns the hashes."""
        block_size = self._engine.snapshot.kv_block_size
        if self.pending is None or not block_size:
            return []
        root = adapter_root(request.adapter.name) if request.HasField("adapter") and request.adapter.name else 0
        hashes = chain_hashes(request.prompt_token_ids, block_size, root=root)
        self.pending.add(hashes)
        return hashes

    def _release_pending(self, hashes: list[int]) -> None:
        if hashes and self.pending is not None:
            self.pending.release(hashes)

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        found = bool(request.request_id) and await self._engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.LoadReport:
        transfers = self.disagg.load_fields() if self.disagg is not None else {}
        if self.prefix_pull is not None:
            transfers.update(self.prefix_pull.load_fields())
        migrations = self.migrator.load_fields() if self.migrator is not None else {}
        fields: dict[str, Any] = {**dataclasses.asdict(self._engine.snapshot), **transfers, **migrations,
                                  **self.adapter_admin.load_fields()}
        report = worker_pb2.LoadReport(worker_id=self.worker_id, incarnation=self.incarnation, submit_stream=True,
                                       **fields)
        events = self.limits.block_events
        if request.block_events and events is not None:
            # A cursor from another incarnation means nothing here: read from 0 (a snapshot).
            since = request.block_events_since if request.block_events_incarnation == self.incarnation else 0
            diff = events.read(since)
            report.block_events_supported = True
            report.block_seq, report.block_snapshot = diff.seq, diff.snapshot
            report.blocks_stored.extend(diff.stored)
            report.blocks_removed.extend(diff.removed)
            report.blocks_stored_tiers.extend(diff.stored_tiers)
        return report

    async def WatchBlocks(self, request: worker_pb2.GetLoadRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.BlockEvents]:
        events, block_size = self.limits.block_events, self._engine.snapshot.kv_block_size
        if events is None or not block_size:
            await _abort(context, grpc.StatusCode.UNIMPLEMENTED, "this worker has no prefix caching: no block events")
        assert events is not None
        async for message in watch_blocks(events, request, self.incarnation, block_size=block_size):
            yield message

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.PrefillResponse]:
        no_transfer = (grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV transfer set up")
        params = await self._admit(request, context, no_transfer if self.disagg is None else None)
        assert self.disagg is not None  # _admit refused the request otherwise
        try:
            if request.HasField("adapter"):  # computed under the request's adapter: loaded here first
                await self.adapter_admin.ensure(request.adapter)
            async for response in self.disagg.prefill(request, params):
                yield response
        except (InvalidRequestError, WorkerUnavailableError, PrefillRejected, *LORA_ERRORS) as e:
            logger.warning("prefill of %s: %s", request.request_id, e)
            await context.abort(*_status_of(e))


    async def PullPrefix(self, request: worker_pb2.PullPrefixRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.PullPrefixResponse:
        if not self.accepting:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "worker is draining or shutting down")
        if self.prefix_pull is None:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV transfer set up")
        try:
            return await self.prefix_pull.serve(request)
        except (WorkerUnavailableError, PrefillRejected) as e:
            logger.warning("prefix pull %s: %s", request.transfer_id, e)
            await _abort(context, *_status_of(e))

    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.AdapterInfo:
        try:
            return await self.adapter_admin.load(request)
        except LORA_ERRORS as e:
            await _abort(context, *_status_of(e))

    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.UnloadAdapterResponse:
        try:
            return self.adapter_admin.unload(request)
        except LORA_ERRORS as e:
            await _abort(context, *_status_of(e))

    async def ListAdapters(self, request: worker_pb2.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.AdapterList:
        return self.adapter_admin.list()

    async def Migrate(self, request: worker_pb2.MigrateRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.MigrateResponse:
        if self.migrator is None:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV transfer set up")
        if request.request_id not in self._inflight:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"request_id: {request.request_id!r} is not in flight here")
        try:
            return await self.migrator.migrate(request.request_id, request.target)
        except MigrationFailed as e:
            await _abort(context, e.code, str(e))

    async def TakeOver(self, request: worker_pb2.TakeOverRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.TakeOverResponse]:
        if self.migrator is None or not self.accepting:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "worker is draining, shutting down or has no KV transfer")
        try:
            async for response in self.migrator.take_over(request):
                yield response
        except MigrationFailed as e:
            logger.warning("take-over of %s: %s", request.request_id, e)
            await _abort(context, e.code, str(e))

    async def Drain(self, request: worker_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:
        return await self.drain(list(request.targets), request.timeout_s or 60.0)

    async def drain(self, targets: list[worker_pb2.MigrationTarget], timeout_s: float) -> worker_pb2.DrainResponse:
        """Stop taking new requests and migrate the running ones to ``targets`` (workers/handoff/drain.py)."""
        from workers.handoff.drain import drain

        self.accepting = False
        if self.on_drain is not None:
            await self.on_drain()
        if self.migrator is None:
            return worker_pb2.DrainResponse(remaining=len(self._inflight))
        self.migrator.draining = True
        return await drain(self.migrator, self.inflight_ids, targets, timeout_s)


class WorkerServer:
    """A running worker: gRPC server + servicer + engine thread. Build with ``start_worker_server``."""

    def __init__(self, server: grpc.aio.Server, servicer: WorkerServicer, engine: EngineLoop,
                 health_servicer: health.aio.HealthServicer, endpoint: str) -> None:
        self.endpoint = endpoint
        self.servicer = servicer
        self.limits = servicer.limits
        self._server, self._engine, self._health = server, engine, health_servicer
        self._stopped = False
        engine.done.add_done_callback(self._on_engine_exit)
        servicer.on_drain = health_servicer.enter_graceful_shutdown

    @property
    def worker_id(self) -> str:
        return self.servicer.worker_id

    @property
    def incarnation(self) -> str:
        return self.servicer.incarnation

    @property
    def engine_done(self) -> asyncio.Future:
        """Resolves when the engine thread exits, with the error that killed it (None on stop)."""
        return self._engine.done

    def _on_engine_exit(self, done: asyncio.Future) -> None:
        if done.result() is not None:  # the engine died under us: stop taking work, say so
            self.servicer.accepting = False
            asyncio.ensure_future(self._health.enter_graceful_shutdown())

    async def stop(self, grace: float = 5.0, migrate_to: list[worker_pb2.MigrationTarget] | None = None) -> None:
        """Stop accepting (NOT_SERVING, new Submits UNAVAILABLE), with ``migrate_to`` first migrate
        the running requests there (workers/handoff/drain.py, within ``grace``), let the in-flight streams
        left finish for the rest of ``grace`` s, abort the rest (status UNAVAILABLE), stop the gRPC
        server and join the engine thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        self.servicer.accepting = False
        await self._health.enter_graceful_shutdown()
        if migrate_to and self.servicer.num_inflight:
            await self.servicer.drain(migrate_to, grace)
        while self.servicer.num_inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.servicer.num_inflight:
            logger.info("worker %s: aborting %d in-flight requests", self.worker_id, self.servicer.num_inflight)
        self._engine.stop()
        await self._engine.wait_closed()
        if self.servicer.migrator is not None:
            await self.servicer.migrator.close()
        if self.servicer.disagg is not None:
            await self.servicer.disagg.close()
        await self.servicer.submit_streams.close(timeout_s=1.0)  # they end once their requests did
        await self._server.stop(grace=1.0)  # the aborted streams send their UNAVAILABLE status
        logger.info("worker %s stopped (%s)", self.worker_id, self.endpoint)


async def start_worker_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 0,
                              worker_id: str | None = None, *, num_threads: int | None = None,
                              max_inflight: int = 1024, kv_transfer_timeout_s: float = 30.0,
                              kv_transfer_backend: str | None = None, migration_attach_timeout_s: float = 30.0,
                              make_engine: Callable[[], Engine] | None = None,
                              timeline: StartupTimeline | None = None, warm_up: bool = True) -> WorkerServer:
    """Load the engine on its own thread, then serve on ``host:port`` (0 = any free port).

    num_threads: torch intra-op threads for the engine thread (match the CPUs reserved for it).
    kv_transfer_timeout_s: bound on every wait on a disaggregation peer (rendezvous, each transfer).
    kv_transfer_backend: 'auto' | 'shm' | 'gloo' | 'nccl' for KV this worker receives
        (workers/kv/transfer.py: auto = shm from peers on this host with a CPU cache, else nccl on
        CUDA, else gloo; gloo and shm stage CUDA caches through pinned host memory); None = the
        engine config's ``kv_transfer_backend``.
    migration_attach_timeout_s: how long a request migrated here decodes without the router attaching
        before it is aborted (workers/handoff/migration_service.py).
    make_engine: builds the engine on the engine thread (default ``build_engine(engine_config)``; a gang
    leader also joins its process group there, see workers/server/gang_actor.py).
    timeline: marks this start's phases (workers/startup.py): the default engine build's, then
    warm_up and serve (a custom ``make_engine`` marks its own).
    warm_up: run one warm-up request before serving; False when this process already paid the
    first-call costs (a promoted standby replica: workers/build.py ``Preloaded.warm_up``).
    """
    if kv_transfer_backend is None:
        kv_transfer_backend = engine_config.kv_transfer_backend
    check_kv_backend(kv_transfer_backend)  # fails before the engine loads; the device is checked once resolved
    loop = asyncio.get_running_loop()
    build = make_engine or (lambda: build_engine(engine_config, timeline=timeline))
    engine = EngineLoop(lambda: _warmed_up(build(), timeline) if warm_up else build(), loop, num_threads=num_threads)
    limits = await engine.start()
    worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
    servicer = WorkerServicer(engine, limits, worker_id, max_inflight)
    if limits.kv_layout is not None:
        servicer.disagg = Disaggregation(engine, limits.kv_layout, worker_id, servicer.incarnation,
                                         host=host if host not in ("0.0.0.0", "::", "") else "127.0.0.1",
                                         device=limits.device, timeout_s=kv_transfer_timeout_s,
                                         kv_backend=kv_transfer_backend, fingerprint=limits.kv_fingerprint)
        servicer.prefix_pull = PrefixPull(engine, servicer.disagg, limits.kv_layout.block_size, kv_transfer_timeout_s)
    health_servicer = health.aio.HealthServicer()
    # so_reuseport=0: a second worker on a taken port must fail, not silently share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(_host_port(host, port))
        await server.start()
    except BaseException:
        engine.stop()
        await engine.wait_closed()
        raise
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    endpoint = _host_port(host, bound)
    if servicer.disagg is not None:
        servicer.migrator = Migrator(engine, servicer.disagg, limits, worker_id, servicer.incarnation, endpoint,
                                     to_sampling_params, timeout_s=kv_transfer_timeout_s,
                                     attach_timeout_s=migration_attach_timeout_s)
    if timeline is not None:
        timeline.mark("serve")
    logger.info("worker %s serving on %s (max_model_len %d)", worker_id, endpoint, limits.max_model_len)
    return WorkerServer(server, servicer, engine, health_servicer, endpoint)


def _warmed_up(engine: Engine, timeline: StartupTimeline | None) -> Engine:
    engine.warm_up()  # on the engine thread, before SERVING: the first request's TTFT is a steady-state one
    if timeline is not None:
        timeline.mark("warm_up")
    return engine


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 literals need brackets
