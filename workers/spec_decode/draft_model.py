"""DraftModelProposer: drafts from a small LM in its own process (the drafter actor), over gRPC.

The worker (target) keeps, per request, what the drafter holds (``held``: context + its drafts)
and sends only diffs (drafter.proto): keep = the common prefix of ``held`` and the request's
tokens now, then the tokens after it. So after a verify that kept j drafts the drafter rolls back
to them and computes one or two tokens before drafting again.

Overlap (PEARL's post-verify): with ``overlap``, each call drafts one token more than asked; that
last one is the drafter's guess of the target's own next token. Right after the drafts come back,
and before the target verifies them, the proposer asks the drafter for the *next* window as if all
drafts and the guess were accepted. The drafter computes it while the target verifies. If the
target indeed accepts everything and its token equals the guess, the next window is ready when the
next step asks; otherwise it is discarded (the drafter rolls back on the next call).

Degradation, not failure: a drafter call that fails or exceeds ``timeout_s`` leaves the step's
requests without drafts (counted in ``stats().fallbacks``); the target decodes plainly. The
proposer then re-attaches in the background: ``connect`` starts a (re)connection (for the Ray
actor: ``start()`` on the restarted actor) which is polled without blocking on later steps, and
drafting resumes with full contexts (the restarted drafter holds nothing).

Axes: K drafts, V vocabulary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from workers.config import EngineConfig, SpeculativeConfig
from workers.errors import ConfigError
from workers.sampling_params import SamplingParams
from workers.spec_decode.drafter_service import GRPC_OPTIONS
from workers.engine.proposer import Draft, DraftAsk, ProposerStats

logger = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 1.0

# connect(): start a (re)connection; returns a poll function that gives the endpoint when ready,
# None while pending, and raises if the attempt failed.
Connector = Callable[[], Callable[[], str | None]]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Request:
    held: list[int] = field(default_factory=list)  # what the drafter holds for this request
    ahead: tuple[int, list[int]] | None = None  # overlap: (batch id, context it assumed)


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, connect: Connector, timeout_s: float = 2.0, overlap: bool = True,
                 initial_wait_s: float = 120.0) -> None:
        """connect: see ``Connector``; timeout_s: a call slower than this (plus 1x per 256 new
        context tokens, for first calls that compute a prompt) drops the drafter; initial_wait_s: how
        long construction waits for the drafter to load before starting without it."""
        self.connect = connect
        self.initial_wait_s = initial_wait_s
        self.actor = None  # the drafter's Ray actor handle, when this proposer created one
        self.timeout_s = timeout_s
        self.overlap = overlap
        # transport_seconds: wall time of synchronous calls beyond the drafter's own compute (the gRPC
        # link, plus queueing behind an overlapped call the drafter is still running)
        self._stats = ProposerStats(extra={"transport_seconds": 0.0, "overlap_hits": 0, "overlap_misses": 0})
        self._requests: dict[str, _Request] = {}
        self._ahead: dict[int, grpc.Future] = {}  # overlap batches in flight
        # calls not waited for (a dropped grpc future cancels its call): releases and prefetches
        self._background: list[grpc.Future] = []
        self._next_batch = 0
        self._channel: grpc.Channel | None = None
        self._stub: drafter_pb2_grpc.DrafterStub | None = None
        self._poll: Callable[[], str | None] | None = None
        self._retry_at = 0.0
        self._attach(initial=True)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, engine: EngineConfig, vocab_size: int) -> DraftModelProposer:
        """A drafter actor of this worker's (Ray owns it; it dies with the worker)."""
        import ray

        from workers.spec_decode.drafter_actor import DrafterActor

        if not ray.is_initialized():
            raise ConfigError("speculative.method='draft_model' runs the drafter as a Ray actor: start the engine "
                              "inside Ray (duet serve does), or pass a proposer to build_engine(...) (workers/build.py)")
        actor = DrafterActor.options(num_cpus=spec.drafter_cpus, resources=dict(spec.drafter_resources),
                                     max_restarts=-1).remote(spec.draft_model, spec.draft_quantization, engine,
                                                             vocab_size, spec.draft_vocab_size,
                                                             spec.drafter_threads)

        def connect() -> Callable[[], str | None]:
            ref = actor.start.remote()

            def poll() -> str | None:
                ready, _ = ray.wait([ref], timeout=0)
                return ray.get(ready[0]) if ready else None
            return poll

        proposer = cls(connect, spec.draft_timeout_s, spec.overlap)
        proposer.actor = actor
        return proposer

    # ------------------------------------------------------------ connection
    def _attach(self, initial: bool = False) -> bool:
        """Poll the pending (re)connection; True once connected. Never blocks (but the first)."""
        if self._stub is not None:
            return True
        now = time.monotonic()
        try:
            if self._poll is None:
                if now < self._retry_at:
                    return False
                self._poll = self.connect()
            endpoint = self._poll()
            deadline = now + self.initial_wait_s
            while endpoint is None and initial and time.monotonic() < deadline:  # wait for the first load
                time.sleep(0.05)
                endpoint = self._poll()
        except Exception as e:  # noqa: BLE001 - any failure to (re)start the drafter: retry later
            logger.warning("drafter not reachable (%s); retrying in %.0f s", e, RECONNECT_INTERVAL_S)
            self._poll, self._retry_at = None, now + RECONNECT_INTERVAL_S
            return False
        if endpoint is None:
            return False
        self._poll = None
        self._channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        if not initial:
            self._stats.reattaches += 1
            logger.info("drafter re-attached at %s", endpoint)
        return True

    def _detach(self, why: str) -> None:
        logger.warning("drafter lost (%s): continuing without speculation until it is back", why)
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self._ahead.clear()
        for st in self._requests.values():  # a restarted drafter holds nothing
            st.held, st.ahead = [], None
        self._retry_at = time.monotonic() + RECONNECT_INTERVAL_S

    # --------------------------------------------------------------- drafting
    def propose(self, asks: list[DraftAsk]) -> dict[str, Draft]:
        t0 = time.perf_counter()
        self._stats.calls += 1
        try:
            if not self._attach():
                self._stats.fallbacks += len(asks)
                return {}
            out, fresh = {}, []
            for a in asks:
                ready = self._take_ahead(a)
                if ready is not None:
                    out[a.request_id] = ready
                else:
                    fresh.append(a)
            if fresh and self._stub is None:  # an overlapped call found the drafter gone just now
                self._stats.fallbacks += len(fresh)
            elif fresh:
                out.update(self._call(fresh))
            return out
        finally:
            self._stats.seconds += time.perf_counter() - t0

    def _take_ahead(self, a: DraftAsk) -> Draft | None:
        """The overlapped window for this request, if its assumption held (all drafts and the guess
        accepted); else None (and the drafter's held context is updated from it)."""
        st = self._requests.get(a.request_id)
        if st is None or st.ahead is None:
            return None
        batch, ctx = st.ahead
        st.ahead = None
        fut = self._ahead.get(batch)
        if fut is None:
            return None
        try:
            resp = fut.result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            self._detach("overlapped draft timed out")
            return None
        except grpc.RpcError as e:
            self._detach(f"overlapped draft failed: {e.code().name}")
            return None
        d = next((d for d in resp.drafts if d.request_id == a.request_id), None)
        if d is None or d.resync:
            st.held = []
            return None
        st.held = ctx + list(d.token_ids)
        if ctx != a.token_ids or not d.token_ids:
            self._stats.extra["overlap_misses"] += 1
            return None
        self._stats.extra["overlap_hits"] += 1
        self._launch_ahead([(a, list(d.token_ids), _probs(d))])
        return _draft(list(d.token_ids), _probs(d), a.num_tokens)

    def _call(self, asks: list[DraftAsk], retry: bool = True) -> dict[str, Draft]:
        extra = 1 if self.overlap else 0
        items = []
        for a in asks:
            st = self._requests.setdefault(a.request_id, _Request())
            keep = _common_prefix(st.held, a.token_ids)
            items.append(drafter_pb2.DraftItem(request_id=a.request_id, keep=keep, new_token_ids=a.token_ids[keep:],
                                               num_tokens=a.num_tokens + extra, sampling=_sampling(a.params)))
        new_tokens = sum(len(i.new_token_ids) for i in items)
        resp = self._rpc(drafter_pb2.ProposeRequest(items=items), self.timeout_s * (1 + new_tokens / 256))
        if resp is None:
            self._stats.fallbacks += len(asks)
            return {}
        by_id = {d.request_id: d for d in resp.drafts}
        out, resync, ahead = {}, [], []
        for a in asks:
            d = by_id.get(a.request_id)
            st = self._requests[a.request_id]
            if d is None or d.resync:
                st.held = []
                resync.append(a)
                continue
            tokens, probs = list(d.token_ids), _probs(d)
            st.held = a.token_ids + tokens
            if tokens:
                out[a.request_id] = _draft(tokens, probs, a.num_tokens)
                if extra and len(tokens) > a.num_tokens:
                    ahead.append((a, tokens, probs))
        if resync and retry and self._stub is not None:
            out.update(self._call(resync, retry=False))
        if ahead:
            self._launch_ahead(ahead)
        return out

    def _launch_ahead(self, windows: list[tuple[DraftAsk, list[int], torch.Tensor | None]]) -> None:
        """Overlap: ask now for the windows after these drafts, assuming all of them and the guess
        (their last token) are accepted."""
        if self._stub is None:
            return
        items = []
        for a, tokens, _ in windows:
            ctx = a.token_ids + tokens
            st = self._requests[a.request_id]
            st.ahead = (self._next_batch, ctx)
            items.append(drafter_pb2.DraftItem(request_id=a.request_id, keep=len(ctx), num_tokens=a.num_tokens + 1,
                                               sampling=_sampling(a.params)))
        self._ahead = {b: f for b, f in self._ahead.items() if not f.done()}  # drop finished, unclaimed ones
        self._ahead[self._next_batch] = self._stub.Propose.future(drafter_pb2.ProposeRequest(items=items),
                                                                   timeout=self.timeout_s * 4)
        self._next_batch += 1

    def _rpc(self, req: drafter_pb2.ProposeRequest, timeout: float) -> drafter_pb2.ProposeResponse | None:
        t0 = time.perf_counter()
        try:
            resp = self._stub.Propose(req, timeout=timeout)
        except grpc.RpcError as e:
            self._detach(f"Propose {e.code().name}: {e.details()}")
            return None
        self._stats.extra["transport_seconds"] += max(0.0, time.perf_counter() - t0 - resp.compute_seconds)
        return resp

    def prefetch(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """Disaggregated decode: the drafter computes the prompt's KV while ours is in transit (the
        call is not waited for; the next Propose queues behind it on the drafter)."""
        if not self._attach():
            return
        st = self._requests.setdefault(request_id, _Request())
        item = drafter_pb2.DraftItem(request_id=request_id, keep=0, new_token_ids=token_ids, num_tokens=0,
                                     sampling=_sampling(params))
        self._keep(self._stub.Propose.future(drafter_pb2.ProposeRequest(items=[item]),
                                             timeout=self.timeout_s * (1 + len(token_ids) / 256)))
        st.held = list(token_ids)

    def release(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None and self._stub is not None:
            self._keep(self._stub.Release.future(drafter_pb2.ReleaseRequest(request_ids=[request_id]),
                                                 timeout=self.timeout_s))

    def _keep(self, future: grpc.Future) -> None:
        self._background = [f for f in self._background if not f.done()]
        self._background.append(future)

    def stats(self) -> ProposerStats:
        return self._stats

    def close(self) -> None:
        """Let the last background calls land (briefly), then close the channel."""
        for f in self._background:
            try:
                f.result(timeout=self.timeout_s)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass
        self._background.clear()
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def _sampling(p: SamplingParams) -> drafter_pb2.Sampling:
    s = drafter_pb2.Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
    if p.seed is not None:
        s.seed = p.seed
    return s


def _probs(d: drafter_pb2.Drafted) -> torch.Tensor | None:
    if not d.probs:
        return None
    return torch.frombuffer(bytearray(d.probs), dtype=torch.float32).view(-1, d.vocab_size)  # [K, V]


def _draft(tokens: list[int], probs: torch.Tensor | None, k: int) -> Draft:
    return Draft(tokens[:k], None if probs is None else probs[:k])
