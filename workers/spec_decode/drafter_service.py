"""A drafter replica's process side: the ``duet.drafter.v1.Drafter`` gRPC service around one
DraftEngine (the Ray actor shell that hosts it is workers/spec_decode/drafter_actor.py; this module
does not import Ray, so a drafter also serves in a plain process).

Threads. gRPC serves each target's ``Rounds`` stream on a thread of its own (a reader per stream
hands the target's rounds and releases to the scheduler); ONE scheduler thread (``DraftScheduler``)
owns the engine. It takes whatever every stream sent since its last pass, adds the items to the
engine and runs one batched forward pass (``DraftEngine.step``), so the rounds of all targets run
as one continuous batch; a round's response goes back on its own stream as soon as its last item is
done. Within one stream rounds are applied in the order sent, so the diffs of drafter.proto stay
consistent (an overlapped round drafting the next window is always applied before the round after
it). Every ``expire_every_s`` the scheduler frees requests idle for ``idle_timeout_s``.

Worked example (what draft_model.DraftModelProposer's link does)::

    server, endpoint = serve_drafter(DraftEngine(EngineConfig(model=str(path), quantization="int8")))
    stub = drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(endpoint, options=GRPC_OPTIONS))
    for response in stub.Rounds(iter([drafter_pb2.RoundRequest(round=1, items=[...])])):
        print(response.round, [list(d.token_ids) for d in response.drafts])
    server.stop(grace=0)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from workers.errors import InvalidRequestError
from workers.sampling_params import SamplingParams
from workers.spec_decode.drafter import DraftEngine, DraftItem, DraftResult

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # sampled drafts carry [K, V] float32 distributions
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
MAX_STREAMS = 64  # targets served at once (a thread each)
IDLE_TIMEOUT_S = 60.0


def _params(s: drafter_pb2.Sampling) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                          seed=s.seed if s.HasField("seed") else None)


def item_from_proto(i: drafter_pb2.DraftItem) -> DraftItem:
    """Raises InvalidRequestError for bad sampling fields."""
    return DraftItem(i.request_id, i.keep, list(i.new_token_ids), i.num_tokens, _params(i.sampling),
                     full_context=i.full_context, held_len=i.held_len, vocab_limit=i.vocab_limit)


@dataclass(eq=False)
class _Round:
    round_id: int
    results: list[DraftResult]
    reply: Callable[[drafter_pb2.RoundResponse], None]
    arrived: float
    started: float = 0.0
    left: int = 0


class DraftScheduler:
    """The engine's one thread (module docstring). ``submit`` and ``release`` are thread-safe."""

    def __init__(self, engine: DraftEngine, *, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 expire_every_s: float = 1.0) -> None:
        self.engine = engine
        self.incarnation = uuid.uuid4().hex[:12]
        self.idle_timeout_s = idle_timeout_s
        self.expire_every_s = expire_every_s
        self._cv = threading.Condition()
        self._queue: list[tuple] = []  # ("round", ...) / ("release", ids), in arrival order
        self._owner: dict[int, _Round] = {}  # id(result) -> its round
        self._stopped = False
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="drafter-scheduler", daemon=True)
        self._thread.start()

    def submit(self, round_id: int, items: list[DraftItem | _Invalid],
               reply: Callable[[drafter_pb2.RoundResponse], None]) -> None:
        """Queue a round (_Invalid items: refused ones, answered with no drafts); ``reply`` gets its
        response on the scheduler thread."""
        with self._cv:
            self._queue.append(("round", round_id, items, reply, time.perf_counter()))
            self._cv.notify()

    def release(self, request_ids: list[str]) -> None:
        with self._cv:
            self._queue.append(("release", request_ids))
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        last_expire = time.monotonic()
        while True:
            with self._cv:
                while not self._queue and not self.engine.has_work and not self._stopped:
                    self._cv.wait(timeout=self.expire_every_s)
                    if time.monotonic() - last_expire >= self.expire_every_s:
                        break
                if self._stopped:
                    return
                todo, self._queue = self._queue, []
            try:
                for op in todo:
                    self._apply(op)
                if self.engine.has_work:
                    self._complete(self.engine.step())
                if time.monotonic() - last_expire >= self.expire_every_s:
                    last_expire = time.monotonic()
                    self.engine.expire(self.idle_timeout_s)
            except Exception:  # a bug: log it; the targets time out and decode without drafts
                logger.exception("drafter: scheduler pass failed")

    def _apply(self, op: tuple) -> None:
        if op[0] == "release":
            for rid in op[1]:
                self.engine.release(rid)
            return
        _, round_id, items, reply, arrived = op
        self.rounds += 1
        r = _Round(round_id, [], reply, arrived, time.perf_counter())
        for item in items:
            res = DraftResult(item.request_id, done=True) if isinstance(item, _Invalid) else self.engine.add(item)
            r.results.append(res)
            if not res.done:
                self._owner[id(res)] = r
                r.left += 1
        if r.left == 0:
            self._reply(r)

    def _complete(self, finished: list[DraftResult]) -> None:
        for res in finished:
            r = self._owner.pop(id(res), None)
            if r is None:
                continue
            r.left -= 1
            if r.left == 0:
                self._reply(r)

    def _reply(self, r: _Round) -> None:
        out = drafter_pb2.RoundResponse(round=r.round_id, incarnation=self.incarnation,
                                        queue_seconds=r.started - r.arrived)
        for res in r.results:
            d = out.drafts.add(request_id=res.request_id, token_ids=res.token_ids, resync=res.resync)
            if res.probs:
                probs = torch.stack(res.probs).float().contiguous()  # [K, V]
                d.probs = probs.numpy().tobytes()
                d.vocab_size = probs.shape[1]
        out.compute_seconds = time.perf_counter() - r.started
        try:
            r.reply(out)
        except Exception:  # noqa: BLE001 - the stream is gone: nobody waits for this round
            logger.debug("drafter: round %d's stream is gone", r.round_id)


@dataclass(frozen=True)
class _Invalid:
    """An item whose sampling fields were refused: answered with no drafts."""

    request_id: str


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, scheduler: DraftScheduler, worker_id: str = "") -> None:
        self.scheduler = scheduler
        self.worker_id = worker_id
        self.num_streams = 0
        self._lock = threading.Lock()

    @property
    def incarnation(self) -> str:
        return self.scheduler.incarnation

    def Rounds(self, request_iterator: Iterator[drafter_pb2.RoundRequest],
               context: grpc.ServicerContext) -> Iterator[drafter_pb2.RoundResponse]:
        out: queue.SimpleQueue = queue.SimpleQueue()
        peer = {"target": context.peer()}
        threading.Thread(target=self._read, args=(request_iterator, out, peer), name="drafter-stream-reader",
                         daemon=True).start()
        with self._lock:
            self.num_streams += 1
        try:
            while (resp := out.get()) is not None:
                yield resp
        finally:
            with self._lock:
                self.num_streams -= 1
            logger.info("drafter: stream of %s closed", peer["target"])

    def _read(self, requests: Iterator[drafter_pb2.RoundRequest], out: queue.SimpleQueue, peer: dict) -> None:
        try:
            for req in requests:
                if req.target and req.target != peer["target"]:
                    peer["target"] = req.target
                    logger.info("drafter: stream opened by %s", req.target)
                if req.release:
                    self.scheduler.release(list(req.release))
                if req.round:
                    self.scheduler.submit(req.round, [_item(i) for i in req.items], out.put)
        except grpc.RpcError:
            pass  # the target went away (it closed the stream, or its process ended)
        except Exception:  # a bug in this reader: end the stream (the target falls back)
            logger.exception("drafter: reading the stream of %s failed", peer["target"])
        finally:
            out.put(None)

    def GetLoad(self, request: drafter_pb2.GetDrafterLoadRequest,
                context: grpc.ServicerContext) -> drafter_pb2.DrafterLoad:
        return load_report(self.scheduler, self.worker_id, self.num_streams)


def _item(i: drafter_pb2.DraftItem) -> DraftItem | _Invalid:
    try:
        return item_from_proto(i)
    except InvalidRequestError as e:
        logger.warning("drafter: request %s: %s; no drafts for it", i.request_id, e)
        return _Invalid(i.request_id)


def load_report(scheduler: DraftScheduler, worker_id: str, num_streams: int) -> drafter_pb2.DrafterLoad:
    """The replica's DrafterLoad (reads counters the scheduler thread writes: a snapshot, not atomic)."""
    engine = scheduler.engine
    bm = engine.block_manager
    s = engine.stats()
    return drafter_pb2.DrafterLoad(
        worker_id=worker_id, incarnation=scheduler.incarnation, model=engine.model_path.name,
        num_requests=engine.num_requests, num_active=engine.num_active, num_streams=num_streams,
        kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_blocks - bm.num_free_blocks, kv_block_size=bm.block_size,
        rounds=scheduler.rounds, items=s.items, draft_tokens=s.draft_tokens, forward_passes=s.forward_passes,
        batched_rows=s.batched_rows, tokens_computed=s.tokens_computed, compute_seconds=s.compute_seconds, evictions=s.evictions, expired=s.expired,
        releases=s.releases, resyncs=s.resyncs)


class DrafterServer:
    """A serving drafter: the gRPC server and its scheduler (``serve_drafter``)."""

    def __init__(self, server: grpc.Server, servicer: DrafterServicer) -> None:
        self._server = server
        self.servicer = servicer

    @property
    def scheduler(self) -> DraftScheduler:
        return self.servicer.scheduler

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving (open streams end) and the scheduler thread."""
        self._server.stop(grace).wait(10)
        self.scheduler.stop()


def serve_drafter(engine: DraftEngine, host: str = "127.0.0.1", port: int = 0, *, worker_id: str = "",
                  idle_timeout_s: float = IDLE_TIMEOUT_S) -> tuple[DrafterServer, str]:
    """Start the service on a free port; returns (server, "host:port")."""
    servicer = DrafterServicer(DraftScheduler(engine, idle_timeout_s=idle_timeout_s), worker_id)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_STREAMS + 4, thread_name_prefix="drafter"),
                         options=GRPC_OPTIONS, maximum_concurrent_rpcs=MAX_STREAMS + 4)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    server.start()
    return DrafterServer(server, servicer), (f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}")


def endpoint_connector(endpoint: str):
    """A Connector (draft_model.py) for a drafter already serving at ``endpoint`` (an in-process
    ``serve_drafter`` in tests and single-process use)."""
    return lambda: (lambda: endpoint)
