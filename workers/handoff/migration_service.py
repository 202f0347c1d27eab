"""Live migration between two workers, on the worker's event loop (the gRPC side of
workers/engine/migration.py). Every worker can be a source or a target.

Sequence for request R (S = source, T = target; the router or a draining S calls S.Migrate(R, T))::

    S  engine.pause_request(R)       R leaves S's running set at a step boundary, keeps its blocks
    S -> T  TakeOver(state, S's identity, model fingerprint, KV layout)      [gRPC, worker to worker]
    T  refuse a different model / layout (FAILED_PRECONDITION) or a draining T (UNAVAILABLE)
    T  engine.reserve_migration      prefix-cache hits + blocks for the rest (RESOURCE_EXHAUSTED if none)
    T  receiver.expect + channel     the pair (S -> T) as for prefill -> decode (workers/kv/transfer.py)
    T -> S  TakeOverResponse #1 (transfer id, blocks wanted, store address, pair generation)
    S  engine.migration_kv(R, first_block); sender.send on the pair            [torch.distributed]
    T  verify (layout, ids, sequence numbers, checksums) -> engine.adopt: R decodes on T, its outputs
       wait in a parked sink for the router
    T -> S  TakeOverResponse #2 (resumed)
    S  engine.hand_over(R)           frees R on S; R's Submit stream ends with ``migrated_to``
    router -> T  Submit(prompt + streamed tokens, migration_id)    attaches to the parked sink

Failure before #2 reaches S (T unreachable, refusing, full, dying; the transfer failing or not
verifying; S's own deadline): S cancels the call (T's handler aborts the reservation: no block
leaks) and resumes R where it was, nothing lost. If S dies after pausing, T's call is cancelled
the same way, and the router resumes R by recompute (S's stream broke). If T already resumed R but
S never hears of it (or the router never attaches), R is aborted on T after ``attach_timeout_s``:
the client only ever follows one stream, so nothing is duplicated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.detokenizer import DetokenizerState
from workers.handoff.disagg import CHANNEL_OPTIONS, Disaggregation, PrefillRejected
from workers.engine.loop import EngineLimits, EngineLoop, Sink, WorkerUnavailableError
from workers.errors import InvalidRequestError
from workers.lora.errors import AdapterCapacityError, AdapterError, AdapterNotLoaded, LoraDisabled
from workers.engine.kv_handoff import KVCapacityError
from workers.kv.transfer import KVTransferError
from workers.engine.migration import MigrationError, MigrationSnapshot
from workers.engine.proposer import DrafterRef
from workers.sampling_params import SamplingParams
from workers.structured.convert import spec_to_proto

logger = logging.getLogger(__name__)


class MigrationFailed(Exception):
    """A migration did not happen; the request still runs where it was. ``code``: the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def params_to_proto(p: SamplingParams) -> worker_pb2.SamplingParams:
    """Engine params -> the wire's resolved SamplingParams (the inverse of service.to_sampling_params)."""
    msg = worker_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty, min_p=p.min_p,
        min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias))
    if p.seed is not None:
        msg.seed = p.seed
    if p.num_speculative_tokens is not None:
        msg.num_speculative_tokens = p.num_speculative_tokens
    if p.top_logprobs is not None:
        msg.top_logprobs = p.top_logprobs
    if p.structured is not None:  # the target's grammar matcher follows the request's tokens from there
        msg.structured.CopyFrom(spec_to_proto(p.structured, worker_pb2.StructuredOutput))
    return msg


def snapshot_to_proto(snap: MigrationSnapshot) -> worker_pb2.MigrationState:
    d = snap.detokenizer
    msg = worker_pb2.MigrationState(
        prompt_token_ids=snap.prompt_token_ids, output_token_ids=snap.output_token_ids,
        sampling=params_to_proto(snap.params), num_computed_tokens=snap.num_computed_tokens,
        num_resumed_tokens=snap.num_resumed_tokens, num_cached_tokens=snap.num_cached_tokens,
        generator_state=snap.generator_state or b"")
    if d is not None:
        msg.detok_ids.extend(d.ids)
        msg.detok_prefix_offset, msg.detok_read_offset, msg.detok_text, msg.detok_emitted = \
            d.prefix_offset, d.read_offset, d.text, d.emitted
    if snap.spec_state is not None:
        msg.spec_acceptance, msg.spec_steps_at_zero = snap.spec_state
    if snap.drafter is not None:
        msg.drafter.CopyFrom(worker_pb2.DrafterRef(worker_id=snap.drafter.worker_id, endpoint=snap.drafter.endpoint,
                                                   incarnation=snap.drafter.incarnation))
    if snap.adapter:
        msg.adapter.CopyFrom(worker_pb2.AdapterRef(name=snap.adapter, source=snap.adapter_source))
    return msg


def snapshot_from_proto(request_id: str, msg: worker_pb2.MigrationState,
                        to_params: Callable[[worker_pb2.SamplingParams], SamplingParams]) -> MigrationSnapshot:
    """Raises InvalidRequestError (bad sampling fields) or MigrationError (inconsistent state)."""
    detok = DetokenizerState(list(msg.detok_ids), msg.detok_prefix_offset, msg.detok_read_offset, msg.detok_text,
                             msg.detok_emitted) if msg.detok_ids else None
    if detok is not None and not (detok.prefix_offset <= detok.read_offset <= len(detok.ids)
                                  and detok.emitted <= len(detok.text)):
        raise MigrationError("detokenizer state: offsets out of range")
    snap = MigrationSnapshot(
        request_id, list(msg.prompt_token_ids), list(msg.output_token_ids), to_params(msg.sampling),
        msg.num_computed_tokens, msg.num_resumed_tokens, msg.num_cached_tokens, msg.generator_state or None, detok,
        (msg.spec_acceptance, msg.spec_steps_at_zero) if msg.HasField("spec_acceptance") else None,
        DrafterRef(msg.drafter.worker_id, msg.drafter.endpoint, msg.drafter.incarnation)
        if msg.HasField("drafter") else None,
        msg.adapter.name if msg.HasField("adapter") else "", msg.adapter.source if msg.HasField("adapter") else "")
    snap.check()
    return snap


@dataclass
class MigrationStats:
    """Counters since the worker started (exported in LoadReport)."""

    migrations_out: int = 0
    migrations_in: int = 0
    migration_failures: int = 0
    migration_kv_bytes: int = 0
    migration_seconds: float = 0.0


@dataclass
class _Parked:
    """Target side: a migrated request decoding here, waiting for the router to attach."""

    migration_id: str
    token_ids: list[int]  # prompt + generated at the handover: what the router's attach must send
    sink: Sink
    timer: asyncio.TimerHandle | None = None


class Migrator:
    """One worker's migration halves (see the module docstring). Runs on the event loop only.

    timeout_s bounds every wait on the peer; attach_timeout_s how long a migrated request waits
    (decoding) for the router to attach before it is aborted."""

    def __init__(self, engine: EngineLoop, disagg: Disaggregation, limits: EngineLimits, worker_id: str,
                 incarnation: str, endpoint: str, to_params: Callable[[worker_pb2.SamplingParams], SamplingParams],
                 *, timeout_s: float = 30.0, attach_timeout_s: float = 30.0) -> None:
        assert limits.kv_layout is not None
        self.stats = MigrationStats()
        self.draining = False
        self.worker_id, self.incarnation, self.endpoint = worker_id, incarnation, endpoint
        self.timeout_s, self.attach_timeout_s = timeout_s, attach_timeout_s
        self.fingerprint = limits.model_fingerprint
        self._layout_words = limits.kv_layout.as_words()
        self._engine, self._disagg, self._to_params = engine, disagg, to_params
        self._adapters = limits.adapters  # LoRA: a migrated request's adapter is loaded here before it resumes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._moved: dict[str, worker_pb2.MigratedTo] = {}  # source: handed over, stream not yet ended
        self._parked: dict[str, _Parked] = {}  # target: resumed here, router not attached yet
        self._migrating: set[str] = set()  # source: in flight

    # ------------------------------------------------------------- source
    async def migrate(self, request_id: str, target: worker_pb2.MigrationTarget) -> worker_pb2.MigrateResponse:
        """Move request_id to ``target``. Raises MigrationFailed (the request still runs here)."""
        if not target.worker_id or not target.endpoint:
            raise MigrationFailed(grpc.StatusCode.INVALID_ARGUMENT, "target.worker_id and target.endpoint: required")
        if target.worker_id == self.worker_id:
            raise MigrationFailed(grpc.StatusCode.INVALID_ARGUMENT, "target: is this worker")
        if request_id in self._migrating:
            raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION, f"{request_id} is already migrating")
        self._migrating.add(request_id)
        start = time.monotonic()
        try:
            snap = await self._engine.call(lambda e: e.pause_request(request_id))
            if isinstance(snap, WorkerUnavailableError):
                raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, str(snap))
            if isinstance(snap, MigrationError):
                code = grpc.StatusCode.NOT_FOUND if "not running here" in str(snap) else grpc.StatusCode.FAILED_PRECONDITION
                raise MigrationFailed(code, str(snap))
            if isinstance(snap, Exception):
                raise MigrationFailed(grpc.StatusCode.INTERNAL, f"pausing {request_id}: {snap!r}")
            try:
                reply = await self._send(snap, target)
            except MigrationFailed as e:
                self.stats.migration_failures += 1
                resumed = await self._engine.call(lambda eng: eng.resume_request(request_id))
                logger.warning("migration of %s to %s failed (%s); %s here", request_id, target.worker_id, e,
                               "it continues" if resumed is True else "it ended meanwhile")
                raise
        finally:
            self._migrating.discard(request_id)
        seconds = time.monotonic() - start
        self._moved[request_id] = worker_pb2.MigratedTo(
            worker_id=target.worker_id, endpoint=target.endpoint, incarnation=reply.target_incarnation,
            migration_id=reply.transfer_id, num_output_tokens=len(snap.output_token_ids))
        done = await self._engine.hand_over(request_id)
        if done is not True:  # aborted while migrating: the target's copy is never attached (times out there)
            self._moved.pop(request_id, None)
            raise MigrationFailed(grpc.StatusCode.NOT_FOUND, f"{request_id} ended while migrating")
        s = self.stats
        s.migrations_out, s.migration_kv_bytes, s.migration_seconds = \
            s.migrations_out + 1, s.migration_kv_bytes + reply.kv_bytes, s.migration_seconds + seconds
        logger.info("request %s migrated to %s: %d blocks, %.2f MB, paused %.1f ms", request_id, target.worker_id,
                    reply.num_blocks, reply.kv_bytes / 1e6, seconds * 1e3)
        return worker_pb2.MigrateResponse(migration_id=reply.transfer_id, blocks_sent=reply.num_blocks,
                                          kv_bytes=reply.kv_bytes, seconds=seconds)

    async def _send(self, snap: MigrationSnapshot, target: worker_pb2.MigrationTarget) -> worker_pb2.TakeOverResponse:
        """TakeOver + the KV transfer; -> the reservation, with kv_bytes set. Raises MigrationFailed."""
        call = self.stub(target.endpoint).TakeOver(worker_pb2.TakeOverRequest(
            request_id=snap.request_id, state=snapshot_to_proto(snap), source_worker_id=self.worker_id,
            source_incarnation=self.incarnation, model_fingerprint=self.fingerprint, kv_layout=self._layout_words,
            expected_incarnation=target.incarnation, source_endpoint=self.endpoint), timeout=4 * self.timeout_s)
        try:
            first = await asyncio.wait_for(call.read(), self.timeout_s)
            if first is grpc.aio.EOF:
                raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, f"{target.worker_id} ended TakeOver without a reservation")
            kv = await self._engine.call(lambda e: e.migration_kv(snap.request_id, first.first_block))
            if isinstance(kv, Exception):
                raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION, f"reading the KV: {kv}")
            if kv.shape[2] != first.num_blocks:
                raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"num_blocks: {first.num_blocks} reserved on {target.worker_id}, {kv.shape[2]} held")
            try:
                sender = self._disagg.sender_for(first.backend)
            except PrefillRejected as e:
                raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
            key = self._disagg.sender_key(target.worker_id, first.target_incarnation, first.pair_generation,
                                          first.backend)
            channel = await asyncio.wait_for(asyncio.wrap_future(sender.channel(key, first.kv_store_address)),
                                             self.timeout_s)
            nbytes = await asyncio.get_running_loop().run_in_executor(
                channel.executor, sender.send, channel, first.transfer_id, first.first_block, kv)
            done = await asyncio.wait_for(call.read(), self.timeout_s)
            if done is grpc.aio.EOF or not done.resumed:
                raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, f"{target.worker_id} did not confirm the take-over")
        except grpc.aio.AioRpcError as e:
            raise MigrationFailed(e.code(), f"target {target.worker_id}: {e.details()}") from None
        except (KVTransferError, TimeoutError) as e:
            raise MigrationFailed(grpc.StatusCode.UNAVAILABLE,
                                  f"KV transfer to {target.worker_id} failed: {e or 'timed out'}") from None
        finally:
            if not call.done():
                call.cancel()
        reply = worker_pb2.TakeOverResponse()
        reply.CopyFrom(first)
        reply.kv_bytes = nbytes
        return reply

    def migrated_to(self, request_id: str) -> worker_pb2.MigratedTo | None:
        """Where a request that just ended MIGRATED went (its Submit stream's last message)."""
        return self._moved.pop(request_id, None)

    # ------------------------------------------------------------- target
    async def take_over(self, request: worker_pb2.TakeOverRequest) -> AsyncIterator[worker_pb2.TakeOverResponse]:
        """Serve one TakeOver call (see the module docstring). Raises MigrationFailed."""
        self._refuse_unless_compatible(request)
        rid = request.request_id
        try:
            snap = snapshot_from_proto(rid, request.state, self._to_params)
        except (InvalidRequestError, MigrationError) as e:
            raise MigrationFailed(grpc.StatusCode.INVALID_ARGUMENT, f"state: {e}") from None
        if snap.adapter:  # the request's LoRA adapter, loaded here first (off the engine thread)
            await self._load_adapter(snap.adapter, snap.adapter_source)
        ticket = await self._engine.call(lambda e: e.reserve_migration(snap))
        if isinstance(ticket, KVCapacityError):
            raise MigrationFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room to take {rid} over: {ticket}")
        if isinstance(ticket, InvalidRequestError):
            code = grpc.StatusCode.ALREADY_EXISTS if ticket.field == "request_id" else grpc.StatusCode.FAILED_PRECONDITION
            raise MigrationFailed(code, str(ticket))
        if isinstance(ticket, (LoraDisabled, AdapterNotLoaded)):  # evicted again before the reservation
            raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION, f"state.adapter: {ticket}")
        if isinstance(ticket, Exception):
            raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, str(ticket))
        receiver, adopted = self._disagg.receiver, False
        backend = self._disagg.backend_for(request.source_endpoint)
        key = receiver.pair_key(request.source_worker_id, request.source_incarnation, backend)
        expected = receiver.expect(key, ticket.transfer_id, ticket.first_block, ticket.num_blocks)
        try:
            receiver.channel(key)
            yield worker_pb2.TakeOverResponse(transfer_id=ticket.transfer_id, first_block=ticket.first_block,
                                              num_blocks=ticket.num_blocks, kv_store_address=receiver.address,
                                              pair_generation=key.generation, target_incarnation=self.incarnation,
                                              backend=backend)
            try:
                received = await asyncio.wait_for(asyncio.wrap_future(expected), self.timeout_s)
            except (KVTransferError, TimeoutError) as e:
                raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, f"KV transfer from {request.source_worker_id} "
                                      f"failed: {e or 'timed out'}") from None
            sink: Sink = asyncio.Queue()
            ok = await self._engine.adopt(rid, ticket, received.kv, snap, sink)
            if ok is not True:
                raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, str(ok))
            adopted = True
            self._park(rid, ticket.transfer_id, snap.token_ids, sink)
            s = self.stats
            s.migrations_in, s.migration_kv_bytes = s.migrations_in + 1, s.migration_kv_bytes + received.num_bytes
            yield worker_pb2.TakeOverResponse(resumed=True, kv_bytes=received.num_bytes)
        finally:
            receiver.cancel(ticket.transfer_id)
            if not adopted:  # refused, failed, or the source went away: return the reserved blocks
                self.stats.migration_failures += 1
                self._engine.abort(rid)

    async def _load_adapter(self, name: str, source: str) -> None:
        adapters = self._adapters
        if adapters is None:
            raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"state.adapter: {name!r}: this worker runs without LoRA (lora.enabled is false)")
        try:
            await asyncio.to_thread(adapters.load, name, source)
        except (AdapterError, AdapterCapacityError) as e:
            raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION, f"state.adapter: {e}") from None

    def _refuse_unless_compatible(self, request: worker_pb2.TakeOverRequest) -> None:
        if self.draining:
            raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is draining")
        if request.expected_incarnation and request.expected_incarnation != self.incarnation:
            raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, f"expected_incarnation: {self.worker_id} is "
                                  f"{self.incarnation} (it restarted)")
        if not request.request_id or not request.source_worker_id:
            raise MigrationFailed(grpc.StatusCode.INVALID_ARGUMENT, "request_id and source_worker_id: required")
        if request.model_fingerprint != self.fingerprint:
            raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"model_fingerprint: the source runs {request.model_fingerprint or '?'}, this worker "
                                  f"{self.fingerprint}: a different model, quantization or weights")
        if list(request.kv_layout) != self._layout_words:
            raise MigrationFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"kv_layout: source {list(request.kv_layout)}, this worker {self._layout_words} "
                                  "(layers, block size, kv heads, head dim, dtype)")
        if not request.source_endpoint:
            raise MigrationFailed(grpc.StatusCode.INVALID_ARGUMENT, "source_endpoint: required")

    def _park(self, rid: str, migration_id: str, token_ids: list[int], sink: Sink) -> None:
        parked = self._parked[rid] = _Parked(migration_id, token_ids, sink)
        parked.timer = asyncio.get_running_loop().call_later(self.attach_timeout_s, self._expire, rid, migration_id)

    def _expire(self, rid: str, migration_id: str) -> None:
        parked = self._parked.get(rid)
        if parked is not None and parked.migration_id == migration_id:
            del self._parked[rid]
            logger.warning("migrated request %s: nobody attached within %.0f s; aborted", rid, self.attach_timeout_s)
            self._engine.abort(rid)

    def attach(self, rid: str, migration_id: str, token_ids: list[int]) -> Sink | None:
        """The parked sink of a migrated request, if ``migration_id`` and the tokens match; else None
        (the caller runs the request by recompute; a mismatched parked copy is aborted)."""
        parked = self._parked.get(rid)
        if parked is None:
            return None
        del self._parked[rid]
        if parked.timer is not None:
            parked.timer.cancel()
        if parked.migration_id != migration_id or parked.token_ids != token_ids:
            logger.warning("attach to %s: migration id or tokens differ from the migrated request; recomputing", rid)
            self._engine.abort(rid)
            return None
        return parked.sink

    def is_parked(self, rid: str) -> bool:
        return rid in self._parked

    def is_migrating(self, rid: str) -> bool:
        return rid in self._migrating

    # ------------------------------------------------------------- lifecycle
    def stub(self, endpoint: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        return worker_pb2_grpc.WorkerStub(channel)

    def load_fields(self) -> dict[str, float | int | bool]:
        s = self.stats
        return dict(migrations_out=s.migrations_out, migrations_in=s.migrations_in,
                    migration_failures=s.migration_failures, migration_kv_bytes=s.migration_kv_bytes,
                    migration_seconds=s.migration_seconds, draining=self.draining)

    async def close(self) -> None:
        for parked in self._parked.values():
            if parked.timer is not None:
                parked.timer.cancel()
        self._parked.clear()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
