"""EngineLoop: one Engine on one dedicated thread, fed by an inbox and read through snapshots.

torch never runs on the asyncio loop, and the engine needs no locks: the engine thread is the only
one that touches it. The RPC side meets it in three places:
  inbox     RPC side -> engine thread: a deque of commands (add, abort; for disaggregation also
            reserve and import, see workers/handoff/disagg.py) under a Condition. The engine
            thread drains it between steps and sleeps on the Condition when it has no work.
  sinks     engine thread -> RPC side: one ``asyncio.Queue`` per request, fed through
            ``loop.call_soon_threadsafe`` (one callback per step, carrying all of that step's outputs).
  snapshot  an immutable ``LoadSnapshot`` the engine thread publishes after every step; readers
            take a reference, so a load query never waits for a step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.block_events import BlockEventLog
from workers.engine.engine import Engine
from workers.engine.kv_handoff import KVCapacityError
from workers.engine.runner import kv_fingerprint
from workers.errors import InvalidRequestError
from workers.lora.adapter_set import AdapterSet
from workers.lora.errors import AdapterNotLoaded, LoraDisabled
from workers.sample.logprobs import TokenLogprob
from workers.engine.migration import MigrationError, MigrationSnapshot
from workers.engine.migration import model_fingerprint as migration_fingerprint
from workers.engine.runner import KVLayout, KVTicket, RequestOutput
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class WorkerUnavailableError(Exception):
    """The engine is shutting down or has failed; the request did not (and will not) finish here."""


@dataclass(frozen=True)
class EngineLimits:
    """Immutable facts about the loaded engine, read once on the engine thread."""

    max_model_len: int
    vocab_size: int
    kv_layout: KVLayout | None = None  # the KV cache geometry (for disaggregated transfers)
    device: str = "cpu"
    model_fingerprint: str = ""  # workers.engine.migration.model_fingerprint: migration peers must agree
    kv_fingerprint: int = 0  # workers/engine/runner.py kv_fingerprint: what KV transfers carry and check
    # What the prefix cache stores and drops (thread-safe; GetLoad reads it for routers), None
    # without prefix caching.
    block_events: BlockEventLog | None = None
    # The LoRA adapter set (thread-safe; the service loads, unloads and lists through it), None
    # without LoRA.
    adapters: AdapterSet | None = None


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's load after its latest step; field meanings as in ``worker_pb2.LoadReport``."""

    num_running: int = 0
    num_waiting: int = 0
    outstanding_tokens: int = 0
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    expert_tokens: tuple[int, ...] = ()
    ep_rank_tokens: tuple[int, ...] = ()
    num_reserved: int = 0
    spec_method: str = "none"
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0
    spec_fallbacks: int = 0
    # lower KV tiers (workers/engine/kv_tiers.py TierStats; 0 when off)
    tier_host_bytes: int = 0
    tier_disk_bytes: int = 0
    tier_host_hits: int = 0
    tier_disk_hits: int = 0
    tier_bytes_to_host: int = 0
    tier_bytes_to_disk: int = 0
    tier_bytes_loaded: int = 0
    tier_host_evictions: int = 0
    tier_disk_evictions: int = 0
    tier_refused_corrupt: int = 0
    tier_refused_foreign: int = 0
    tier_deadline_misses: int = 0
    tier_load_seconds: float = 0.0

    @classmethod
    def of(cls, engine: Engine) -> LoadSnapshot:
        """Engine thread only. outstanding_tokens = sum over unfinished requests of P + M - 1 - C,
        with M capped at the context limit (max_model_len - P): no request can run past it."""
        stats, sched = engine.stats(), engine.scheduler
        sp = stats.spec
        outstanding = 0
        for seq in itertools.chain(sched.running, sched.waiting, engine.reserved()):
            p = seq.num_prompt_tokens
            m = min(seq.sampling_params.max_tokens, engine.max_model_len - p)
            outstanding += max(p + m - 1 - seq.num_computed_tokens, 0)
        b = stats.blocks
        t = stats.tiers
        tiers: dict[str, Any] = {} if t is None else dict(
            tier_host_bytes=t.host_bytes, tier_disk_bytes=t.disk_bytes, tier_host_hits=t.host_hits,
            tier_disk_hits=t.disk_hits, tier_bytes_to_host=t.bytes_to_host, tier_bytes_to_disk=t.bytes_to_disk,
            tier_bytes_loaded=t.bytes_loaded, tier_host_evictions=t.host_evictions,
            tier_disk_evictions=t.disk_evictions, tier_refused_corrupt=t.refused_corrupt,
            tier_refused_foreign=t.refused_foreign, tier_deadline_misses=t.deadline_misses,
            tier_load_seconds=t.load_seconds)
        return cls(stats.num_running, stats.num_waiting, outstanding, engine.block_manager.block_size,
                   b.num_blocks, b.num_blocks - b.num_free_blocks, b.num_cached_blocks,
                   b.prefix_cache_queries, b.prefix_cache_hits, stats.num_preemptions, stats.expert_tokens,
                   stats.ep_rank_tokens, stats.num_reserved, sp.method, sp.num_verifies, sp.num_draft_tokens,
                   sp.num_accepted_tokens, sp.num_emitted_tokens, sp.draft_seconds, sp.verify_seconds,
                   sp.num_fallbacks, **tiers)


Item = RequestOutput | Exception  # what a request's sink receives: outputs, or one error
Sink = asyncio.Queue  # asyncio.Queue[Item], one per request, read by its Submit handler
Delivery = tuple["Sink | asyncio.Future", object]  # (where, what), applied on the event loop


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink
    export_from_block: int | None = None  # prefill side of a disaggregated request
    resumed_output_tokens: int = 0  # see Engine.add_request
    adapter: str = ""  # its LoRA adapter (loaded before it is queued: workers/server/service.py)


@dataclass(frozen=True)
class _Abort:
    request_id: str
    reply: asyncio.Future  # -> found: bool


@dataclass(frozen=True)
class _Reserve:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    reply: asyncio.Future  # -> KVTicket | Exception (InvalidRequestError, KVCapacityError, LoRA errors)
    resumed_output_tokens: int = 0
    adapter: str = ""


@dataclass(frozen=True)
class _Import:
    request_id: str
    ticket: KVTicket
    kv: torch.Tensor  # [L, 2, n, bs, G, D], verified
    first_token: int
    generator_state: bytes | None
    sink: Sink
    first_logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], object]  # run on the engine thread between two steps
    reply: asyncio.Future  # -> its result, or the exception it raised


@dataclass(frozen=True)
class _Adopt:
    """Migration target: import a reserved request's verified KV and decode on; outputs go to ``sink``."""

    request_id: str
    ticket: KVTicket
    kv: torch.Tensor  # [L, 2, n, bs, G, D], verified
    snapshot: MigrationSnapshot
    sink: Sink
    reply: asyncio.Future  # -> True, or WorkerUnavailableError (aborted while in transit)


@dataclass(frozen=True)
class _Handover:
    """Migration source: the target took the paused request over; finish it here (MIGRATED: its
    Submit stream gets the final output) and free it."""

    request_id: str
    reply: asyncio.Future  # -> True, or MigrationError (it ended meanwhile)


Command = _Add | _Abort | _Reserve | _Import | _Call | _Adopt | _Handover


def _apply_deliveries(deliveries: list[Delivery]) -> None:
    """Event loop side of every engine-thread -> RPC hand-off."""
    for target, value in deliveries:
        if isinstance(target, asyncio.Queue):
            target.put_nowait(value)
        elif not target.done():  # (an Abort RPC whose caller went away is done: cancelled)
            target.set_result(value)


def _rejection(cmd: Command, reason: Exception) -> Delivery:
    """The answer to a command the engine thread will never run."""
    if isinstance(cmd, (_Add, _Import)):
        return cmd.sink, reason
    return (cmd.reply, reason) if isinstance(cmd, (_Reserve, _Call, _Adopt, _Handover)) else (cmd.reply, False)


class EngineLoop:
    """Owns one Engine on one dedicated thread. Public methods are for the event loop; none blocks."""

    def __init__(self, make_engine: Callable[[], Engine], loop: asyncio.AbstractEventLoop,
                 num_threads: int | None = None) -> None:
        self._make_engine = make_engine
        self._loop = loop
        self._num_threads = num_threads
        self._cv = threading.Condition()
        self._inbox: deque[Command] = deque()  # guarded by _cv
        self._stopping = False  # guarded by _cv
        self._closed = False  # guarded by _cv; True once the thread reads the inbox no more
        self._ready: asyncio.Future[EngineLimits | None] = loop.create_future()  # None: it failed
        self._start_error: BaseException | None = None
        self.done: asyncio.Future[BaseException | None] = loop.create_future()  # thread exited (error)
        self._thread = threading.Thread(target=self._run, name="duet-engine", daemon=True)
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self.snapshot = LoadSnapshot()  # replaced (never mutated) by the engine thread

    # ------------------------------------------------------------ event loop side
    async def start(self) -> EngineLimits:
        """Start the thread and wait (without blocking the loop) until it has built the engine."""
        self._thread.start()
        limits = await self._ready
        if limits is None:  # the engine failed to load: the thread has exited; re-raise its error
            await self.wait_closed()
            assert self._start_error is not None  # set before _ready resolves to None
            raise self._start_error
        return limits

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink, *,
            export_from_block: int | None = None, resumed_output_tokens: int = 0, adapter: str = "") -> None:
        """Queue a request; its outputs (or one exception) arrive on ``sink``. export_from_block
        (prefill only), resumed_output_tokens, adapter: see ``Engine.add_request``."""
        self._post(_Add(request_id, prompt_token_ids, params, sink, export_from_block, resumed_output_tokens,
                        adapter))

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                resumed_output_tokens: int = 0, adapter: str = "") -> asyncio.Future:
        """Decode side: reserve KV blocks (``Engine.reserve``); the future holds the KVTicket or the error."""
        cmd = _Reserve(request_id, prompt_token_ids, params, self._loop.create_future(), resumed_output_tokens,
                       adapter)
        self._post(cmd)
        return cmd.reply

    def import_kv(self, request_id: str, ticket: KVTicket, kv: torch.Tensor, first_token: int,
                  generator_state: bytes | None, sink: Sink, first_logprob: TokenLogprob | None = None) -> None:
        """Decode side: write a verified transfer and start decoding; outputs arrive on ``sink``."""
        self._post(_Import(request_id, ticket, kv, first_token, generator_state, sink, first_logprob))

    def call(self, fn: Callable[[Engine], object]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread between two steps (for components beside the engine
        that drive its block manager and runner, e.g. workers/handoff/prefix_pull.py). The future holds its
        result, or the exception it raised (as a value, like ``reserve``); commands run in order."""
        cmd = _Call(fn, self._loop.create_future())
        self._post(cmd)
        return cmd.reply

    def adopt(self, request_id: str, ticket: KVTicket, kv: torch.Tensor, snapshot: MigrationSnapshot,
              sink: Sink) -> asyncio.Future:
        """Migration target: write the verified KV and decode on; outputs arrive on ``sink``."""
        cmd = _Adopt(request_id, ticket, kv, snapshot, sink, self._loop.create_future())
        self._post(cmd)
        return cmd.reply

    def hand_over(self, request_id: str) -> asyncio.Future:
        """Migration source: finish the paused request as MIGRATED (its sink gets the final output)."""
        cmd = _Handover(request_id, self._loop.create_future())
        self._post(cmd)
        return cmd.reply

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Abort a request (idempotent); the future says whether the engine still had it."""
        cmd = _Abort(request_id, self._loop.create_future())
        self._post(cmd)
        return cmd.reply

    def stop(self) -> None:
        """Ask the thread to abort everything left (sinks get WorkerUnavailableError) and exit."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    async def wait_closed(self) -> BaseException | None:
        """Wait for the thread to exit, join it, and return the error that killed it (if any)."""
        error = await asyncio.shield(self.done)
        self._thread.join()  # it has already finished: this does not block
        return error

    def _post(self, cmd: Command) -> None:
        with self._cv:
            if not self._closed:
                self._inbox.append(cmd)
                self._cv.notify()
                return
        _apply_deliveries([_rejection(cmd, WorkerUnavailableError("worker is shutting down"))])

    # ------------------------------------------------------------ engine thread
    def _deliver(self, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        try:  # one callback per step, however many requests it touched
            self._loop.call_soon_threadsafe(_apply_deliveries, deliveries)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d deliveries", len(deliveries))

    def _run(self) -> None:
        if self._num_threads:  # OpenMP thread counts are per thread: set it where torch runs
            torch.set_num_threads(self._num_threads)
        try:
            engine = self._make_engine()
            layout = engine.kv_layout()  # None: no KV transfer (so no migration either)
            limits = EngineLimits(
                engine.max_model_len, engine.spec.vocab_size, layout, engine.config.device,
                migration_fingerprint(engine) if layout is not None else "",
                kv_fingerprint(engine.spec, layout.dtype, engine.config.quantization) if layout is not None else 0,
                engine.block_manager.events if engine.block_manager.enable_prefix_caching else None,
                engine.adapters)
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            self._deliver([(self._ready, None)])
            self._close(None, None, deque())
            return
        self.snapshot = LoadSnapshot.of(engine)
        self._deliver([(self._ready, limits)])
        commands: deque[Command] = deque()
        out: list[Delivery] = []  # answers not yet handed to the event loop
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or engine.has_unfinished()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands.extend(self._inbox)
                    self._inbox.clear()
                while commands:
                    self._apply(engine, commands[0], out)
                    commands.popleft()
                if engine.has_unfinished():
                    for o in engine.step():
                        sink = self._sinks.pop(o.request_id, None) if o.finished else self._sinks.get(o.request_id)
                        if sink is not None:  # a failed request (structured output) ends with its error
                            out.append((sink, o if o.error is None else o.error))
                self.snapshot = LoadSnapshot.of(engine)
                self._deliver(out)
                out = []
        except BaseException as e:  # a failed engine fails every request, loudly
            logger.exception("engine loop failed; the worker stops serving")
            self._deliver(out)  # answers made before the failure still count
            self._close(engine, e, commands)
        else:
            self._close(engine, None, commands)

    def _apply(self, engine: Engine, cmd: Command, out: list[Delivery]) -> None:
        if isinstance(cmd, _Add):
            try:
                engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                   export_from_block=cmd.export_from_block,
                                   resumed_output_tokens=cmd.resumed_output_tokens, adapter=cmd.adapter)
            except (InvalidRequestError, LoraDisabled, AdapterNotLoaded) as e:
                out.append((cmd.sink, e))
            else:
                self._sinks[cmd.request_id] = cmd.sink
            return
        if isinstance(cmd, _Reserve):
            try:
                out.append((cmd.reply, engine.reserve(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                                      cmd.resumed_output_tokens, cmd.adapter)))
            except (InvalidRequestError, KVCapacityError, LoraDisabled, AdapterNotLoaded) as e:
                out.append((cmd.reply, e))
            return
        if isinstance(cmd, _Call):
            try:
                out.append((cmd.reply, cmd.fn(engine)))
            except Exception as e:  # noqa: BLE001 - handed to the caller; the engine state is the fn's to keep
                out.append((cmd.reply, e))
            return
        if isinstance(cmd, _Import):
            if cmd.request_id not in {s.request_id for s in engine.reserved()}:  # aborted while in transit
                out.append((cmd.sink, WorkerUnavailableError(f"request {cmd.request_id} was aborted")))
                return
            first = engine.import_kv(cmd.request_id, cmd.ticket, cmd.kv, cmd.first_token, cmd.generator_state,
                                     cmd.first_logprob)
            out.append((cmd.sink, first))
            if not first.finished:
                self._sinks[cmd.request_id] = cmd.sink
            return
        if isinstance(cmd, (_Adopt, _Handover)):
            self._apply_migration(engine, cmd, out)
            return
        final = engine.abort(cmd.request_id)
        sink = self._sinks.pop(cmd.request_id, None)
        if final is not None and sink is not None:
            out.append((sink, final))  # the stream ends normally, with finish_reason ABORT
        out.append((cmd.reply, final is not None))

    def _apply_migration(self, engine: Engine, cmd: _Adopt | _Handover, out: list[Delivery]) -> None:
        if isinstance(cmd, _Adopt):
            if not engine.migration.is_reserved(cmd.request_id):  # aborted while in transit
                out.append((cmd.reply, WorkerUnavailableError(f"request {cmd.request_id} was aborted")))
                return
            engine.import_migration(cmd.request_id, cmd.ticket, cmd.kv, cmd.snapshot)
            self._sinks[cmd.request_id] = cmd.sink
            out.append((cmd.reply, True))
            return
        try:
            final = engine.finish_migrated(cmd.request_id)
        except MigrationError as e:
            out.append((cmd.reply, e))
            return
        sink = self._sinks.pop(cmd.request_id, None)
        if sink is not None:
            out.append((sink, final))
        out.append((cmd.reply, True))

    def _close(self, engine: Engine | None, error: BaseException | None, unapplied: deque) -> None:
        """Abort what is left, answer every command not run, and tell the loop the thread is done."""
        with self._cv:
            self._closed = True
            unapplied.extend(self._inbox)
            self._inbox.clear()
        reason = WorkerUnavailableError(f"worker engine failed: {error!r}" if error else "worker is shutting down")
        out: list[Delivery] = []
        for rid, sink in self._sinks.items():
            if engine is not None and error is None:
                engine.abort(rid)  # frees its KV blocks (a failed engine is not touched again)
            out.append((sink, reason))
        self._sinks.clear()
        if engine is not None and error is None:  # (a failed engine is not touched again)
            self.snapshot = LoadSnapshot.of(engine)
            try:
                engine.close()  # the lower KV tiers' thread, files and memory
            except Exception:  # the loop must still report done; the error is logged
                logger.exception("closing the engine failed (its KV tier files may be left)")
        out += [_rejection(cmd, reason) for cmd in unapplied]
        out.append((self.done, error))
        self._deliver(out)
