"""DraftModelProposer: drafts from a small LM on drafter replicas, over one gRPC stream per replica.

Where a request drafts: on the replica the router picked for it from a drafter pool
(``DraftAsk.drafter``, from SubmitRequest.drafter), else on the worker's private drafter actor
(``connect``; none in a pool deployment). A target keeps one ``DrafterLink`` (drafter_link.py: a
``Rounds`` stream) per replica it uses; each step it sends every replica one round holding all of
its requests drafting there, the rounds of several replicas in parallel, and waits for them.

Diffs (drafter.proto). Per request the proposer remembers what the drafter holds (``held``: context
+ its drafts) and sends only the difference: keep = the common prefix of ``held`` and the request's
tokens now, then the tokens after it. So after a verify that kept j drafts the drafter rolls back
to them and computes one or two tokens before drafting again. A request the proposer knows nothing
about on that replica (its first round here: new, or arriving by P/D hand-off, migration or a
resume; or after a reconnect) sends its whole context with ``full_context``, and the drafter keeps
whatever prefix of it it holds: drafter state is keyed by request, not by target.

Overlap (PEARL's post-verify): with ``overlap``, each round drafts one token more than asked; that
last one is the drafter's guess of the target's own next token. Right after the drafts come back,
and before the target verifies them, the proposer sends the round for the *next* window as if all
drafts and the guess were accepted. The drafter computes it while the target verifies. If the
target indeed accepts everything and its token equals the guess, the next window is ready when the
next step asks; otherwise it is discarded (the drafter rolls back on the next round).

Faults fail open, never changing a token: a round that fails or exceeds ``timeout_s`` leaves its
requests without drafts this step (``stats().fallbacks``) and drops that replica's link; the
target decodes plainly. The link is re-opened in the background (``RECONNECT_INTERVAL_S``; the
private actor is started again through ``connect``), and drafting resumes with full contexts: a
restarted drafter holds nothing, one that only stalled keeps its state.

Axes: K drafts, V vocabulary.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from protos.duet.drafter.v1 import drafter_pb2
from workers.config import EngineConfig, SpeculativeConfig
from workers.engine.proposer import Draft, DraftAsk, DrafterRef, ProposerStats
from workers.errors import ConfigError
from workers.sampling_params import SamplingParams
from workers.spec_decode.drafter_link import DrafterLink, LinkDown

logger = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 1.0
LINK_IDLE_S = 30.0  # a pool replica's stream with no request for this long is closed (and its slot forgotten)
PRIVATE = ""  # the slot key of the worker's own drafter (pool replicas are keyed by endpoint)

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
    slot: str  # which drafter (PRIVATE or an endpoint)
    held: list[int] | None = None  # what the drafter holds for this request; None = unknown (send it all)
    ahead: tuple[Future, list[int]] | None = None  # overlap: (its round, the context it assumed)


@dataclass
class _Slot:
    """One drafter this proposer drafts on, and its link when attached."""

    key: str
    connect: Connector
    link: DrafterLink | None = None
    poll: Callable[[], str | None] | None = None
    retry_at: float = 0.0
    attached_before: bool = False
    incarnation: str = ""
    requests: set[str] = field(default_factory=set)
    idle_since: float = 0.0  # when its last request left (pool replicas: closed after LINK_IDLE_S)


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, connect: Connector | None, timeout_s: float = 2.0, overlap: bool = True,
                 initial_wait_s: float = 120.0, *, vocab_limit: int = 0, target: str = "") -> None:
        """connect: the private drafter (see ``Connector``); None = requests draft only on the
        replica their DraftAsk names. timeout_s: a round slower than this (plus 1x per 256 new
        context tokens, for first rounds that compute a prompt) drops the drafter for the step;
        initial_wait_s: how long construction waits for the private drafter to load before starting
        without it. vocab_limit: the target's vocabulary size (drafts are ids below it; 0 = any).
        target: this worker's name in the drafters' logs."""
        self.initial_wait_s = initial_wait_s
        self.actor = None  # the private drafter's Ray actor handle, when this proposer created one
        self.timeout_s = timeout_s
        self.overlap = overlap
        self.vocab_limit = vocab_limit
        self.target = target or f"{socket.gethostname()}:{os.getpid()}"
        # transport_seconds: wall time of waited rounds beyond the drafter's own compute (the gRPC
        # link, plus queueing behind other rounds on the drafter)
        self._stats = ProposerStats(extra={"transport_seconds": 0.0, "overlap_hits": 0, "overlap_misses": 0,
                                           "rounds": 0})
        self._requests: dict[str, _Request] = {}
        self._slots: dict[str, _Slot] = {}
        if connect is not None:
            self._slots[PRIVATE] = _Slot(PRIVATE, connect)
            self._attach(self._slots[PRIVATE], initial=True)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, engine: EngineConfig, vocab_size: int) -> DraftModelProposer:
        """With speculative.drafter_pool: requests draft on the pool replica the router hands each
        one. Otherwise a drafter actor of this worker's (Ray owns it; it dies with the worker)."""
        if spec.drafter_pool:
            return cls(None, spec.draft_timeout_s, spec.overlap, vocab_limit=vocab_size)
        import ray

        from workers.spec_decode.drafter import private_drafter_config
        from workers.spec_decode.drafter_actor import DrafterActor

        if not ray.is_initialized():
            raise ConfigError("speculative.method='draft_model' runs the drafter as a Ray actor: start the engine "
                              "inside Ray (duet serve does), or pass a proposer to build_engine(...) (workers/build.py)")
        assert spec.draft_model is not None  # SpeculativeConfig requires it without a drafter_pool
        actor = DrafterActor.options(num_cpus=spec.drafter_cpus, resources=dict(spec.drafter_resources),  # type: ignore[attr-defined]  # a @ray.remote class
                                     max_restarts=-1).remote(
            private_drafter_config(spec.draft_model, spec.draft_quantization, engine), vocab_size,
            spec.draft_vocab_size, spec.drafter_threads)

        def connect() -> Callable[[], str | None]:
            ref = actor.start.remote()

            def poll() -> str | None:
                ready, _ = ray.wait([ref], timeout=0)
                return ray.get(ready[0]) if ready else None
            return poll

        proposer = cls(connect, spec.draft_timeout_s, spec.overlap, vocab_limit=vocab_size)
        proposer.actor = actor
        return proposer

    # ------------------------------------------------------------ connection
    def _slot_of(self, drafter: DrafterRef | None) -> _Slot | None:
        """The slot a request with this drafter drafts on (created on first use); None = nowhere."""
        if drafter is None:
            return self._slots.get(PRIVATE)
        slot = self._slots.get(drafter.endpoint)
        if slot is None:
            endpoint = drafter.endpoint
            slot = self._slots[endpoint] = _Slot(endpoint, lambda: (lambda: endpoint))
        return slot

    def _attach(self, slot: _Slot, initial: bool = False) -> bool:
        """Poll the slot's pending (re)connection; True once linked. Never blocks (but the first)."""
        if slot.link is not None:
            if slot.link.alive:
                return True
            self._detach(slot, slot.link.error or "link down")
        now = time.monotonic()
        try:
            if slot.poll is None:
                if now < slot.retry_at:
                    return False
                slot.poll = slot.connect()
            endpoint = slot.poll()
            deadline = now + self.initial_wait_s
            while endpoint is None and initial and time.monotonic() < deadline:  # wait for the first load
                time.sleep(0.05)
                endpoint = slot.poll()
        except Exception as e:  # noqa: BLE001 - any failure to (re)start the drafter: retry later
            logger.warning("drafter %s not reachable (%s); retrying in %.0f s", slot.key or "(private)", e,
                           RECONNECT_INTERVAL_S)
            slot.poll, slot.retry_at = None, now + RECONNECT_INTERVAL_S
            return False
        if endpoint is None:
            return False
        slot.poll = None
        slot.link = DrafterLink(endpoint, self.target)
        if slot.attached_before:
            self._stats.reattaches += 1
            logger.info("drafter re-attached at %s", endpoint)
        slot.attached_before = True
        return True

    def _detach(self, slot: _Slot, why: str) -> None:
        if slot.link is not None:
            logger.warning("drafter %s lost (%s): its requests continue without speculation until it is back",
                           slot.link.endpoint, why)
            slot.link.close()
        slot.link = None
        for rid in slot.requests:  # what the drafter holds is unknown now: the next round sends it all
            st = self._requests.get(rid)
            if st is not None:
                st.held, st.ahead = None, None
        slot.retry_at = time.monotonic() + RECONNECT_INTERVAL_S

    # --------------------------------------------------------------- drafting
    def propose(self, asks: list[DraftAsk]) -> dict[str, Draft]:
        t0 = time.perf_counter()
        self._stats.calls += 1
        self._close_idle()
        try:
            groups: dict[str, list[DraftAsk]] = {}
            for a in asks:
                slot = self._slot_of(a.drafter)
                if slot is None:
                    continue  # no drafter for this request (the router found none healthy): plain decoding
                st = self._request(a.request_id, slot)
                if st.slot != slot.key:  # the request's drafter changed (the router moved it): start over there
                    self._forget(a.request_id)
                    self._request(a.request_id, slot)
                groups.setdefault(slot.key, []).append(a)
            out: dict[str, Draft] = {}
            rounds = []
            for key, group in groups.items():
                slot = self._slots[key]
                if not self._attach(slot):
                    self._stats.fallbacks += len(group)
                    continue
                fresh = []
                for a in group:
                    ready = self._take_ahead(slot, a)
                    if ready is not None:
                        out[a.request_id] = ready
                    elif slot.link is not None:
                        fresh.append(a)
                    else:
                        self._stats.fallbacks += 1  # its overlapped round found the drafter gone just now
                if fresh and slot.link is not None:
                    rounds.append((slot, fresh, *self._send(slot, fresh)))
            for slot, fresh, fut, timeout in rounds:
                out.update(self._collect(slot, fresh, fut, timeout, retry=True))
            return out
        finally:
            self._stats.seconds += time.perf_counter() - t0

    def _request(self, request_id: str, slot: _Slot) -> _Request:
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Request(slot.key)
            slot.requests.add(request_id)
        return st

    def _item(self, a: DraftAsk, extra: int) -> drafter_pb2.DraftItem:
        st = self._requests[a.request_id]
        item = drafter_pb2.DraftItem(request_id=a.request_id, num_tokens=a.num_tokens + extra,
                                     sampling=_sampling(a.params), vocab_limit=self.vocab_limit)
        keep = _common_prefix(st.held, a.token_ids) if st.held else 0
        if keep == 0:
            item.full_context = True
            item.new_token_ids.extend(a.token_ids)
        else:
            assert st.held is not None  # keep > 0
            item.keep, item.held_len = keep, len(st.held)
            item.new_token_ids.extend(a.token_ids[keep:])
        return item

    def _send(self, slot: _Slot, asks: list[DraftAsk]) -> tuple[Future, float]:
        extra = 1 if self.overlap else 0
        items = [self._item(a, extra) for a in asks]
        new_tokens = sum(len(i.new_token_ids) for i in items)
        self._stats.extra["rounds"] += 1
        assert slot.link is not None  # the caller attached it
        return slot.link.send(items), self.timeout_s * (1 + new_tokens / 256)

    def _collect(self, slot: _Slot, asks: list[DraftAsk], fut: Future, timeout: float,
                 retry: bool) -> dict[str, Draft]:
        t0 = time.perf_counter()
        resp = self._wait(slot, fut, timeout)
        if resp is None:
            self._stats.fallbacks += len(asks)
            return {}
        self._stats.extra["transport_seconds"] += max(0.0, time.perf_counter() - t0 - resp.compute_seconds)
        by_id = {d.request_id: d for d in resp.drafts}
        extra = 1 if self.overlap else 0
        out, resync, ahead = {}, [], []
        for a in asks:
            d = by_id.get(a.request_id)
            st = self._requests.get(a.request_id)
            if st is None:
                continue  # released meanwhile
            if d is None or d.resync:
                st.held = None
                resync.append(a)
                continue
            tokens, probs = list(d.token_ids), _probs(d)
            st.held = a.token_ids + tokens
            if tokens:
                out[a.request_id] = _draft(tokens, probs, a.num_tokens)
                if extra and len(tokens) > a.num_tokens:
                    ahead.append((a, tokens))
        if resync and retry and slot.link is not None:
            again, timeout = self._send(slot, resync)
            out.update(self._collect(slot, resync, again, timeout, retry=False))
        if ahead and slot.link is not None:
            self._launch_ahead(slot, ahead)
        return out

    def _wait(self, slot: _Slot, fut: Future, timeout: float) -> drafter_pb2.RoundResponse | None:
        """The round's response, or None after dropping the slot's link (failed or timed out)."""
        try:
            resp = fut.result(timeout=timeout)
        except FutureTimeout:
            self._detach(slot, f"a round took over {timeout:.1f} s")
            return None
        except LinkDown as e:
            self._detach(slot, str(e))
            return None
        if slot.incarnation and resp.incarnation != slot.incarnation:
            logger.warning("drafter %s restarted (incarnation %s -> %s)", slot.key or "(private)", slot.incarnation,
                           resp.incarnation)
        slot.incarnation = resp.incarnation
        return resp

    def _take_ahead(self, slot: _Slot, a: DraftAsk) -> Draft | None:
        """The overlapped window for this request, if its assumption held (all drafts and the guess
        accepted); else None (and the drafter's held context is updated from it)."""
        st = self._requests[a.request_id]
        if st.ahead is None:
            return None
        fut, ctx = st.ahead
        st.ahead = None
        resp = self._wait(slot, fut, self.timeout_s)
        if resp is None:
            return None
        d = next((d for d in resp.drafts if d.request_id == a.request_id), None)
        if d is None or d.resync:
            st.held = None
            return None
        st.held = ctx + list(d.token_ids)
        if ctx != a.token_ids or not d.token_ids:
            self._stats.extra["overlap_misses"] += 1
            return None
        self._stats.extra["overlap_hits"] += 1
        self._launch_ahead(slot, [(a, list(d.token_ids))])
        return _draft(list(d.token_ids), _probs(d), a.num_tokens)

    def _launch_ahead(self, slot: _Slot, windows: list[tuple[DraftAsk, list[int]]]) -> None:
        """Overlap: ask now for the windows after these drafts, assuming all of them and the guess
        (their last token) are accepted."""
        items, contexts = [], []
        for a, tokens in windows:
            ctx = a.token_ids + tokens
            contexts.append((a.request_id, ctx))
            items.append(drafter_pb2.DraftItem(request_id=a.request_id, keep=len(ctx), held_len=len(ctx),
                                               num_tokens=a.num_tokens + 1, sampling=_sampling(a.params),
                                               vocab_limit=self.vocab_limit))
        assert slot.link is not None  # the caller attached it
        fut = slot.link.send(items)
        for rid, ctx in contexts:
            self._requests[rid].ahead = (fut, ctx)

    def prefetch(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 drafter: DrafterRef | None = None) -> None:
        """Disaggregated decode and migration: the drafter computes (or keeps) the context's KV while
        ours is in transit (the round is not waited for; the next one queues behind it there)."""
        slot = self._slot_of(drafter)
        if slot is None or not self._attach(slot):
            return
        self._forget(request_id)
        st = self._request(request_id, slot)
        assert slot.link is not None  # attached just above
        slot.link.send([drafter_pb2.DraftItem(request_id=request_id, full_context=True, new_token_ids=token_ids,
                                              num_tokens=0, sampling=_sampling(params),
                                              vocab_limit=self.vocab_limit)])
        st.held = list(token_ids)

    def release(self, request_id: str, *, handed_over: bool = False) -> None:
        slot = self._forget(request_id)
        if slot is not None and slot.link is not None and not handed_over:
            slot.link.release([request_id])

    def _forget(self, request_id: str) -> _Slot | None:
        st = self._requests.pop(request_id, None)
        if st is None:
            return None
        slot = self._slots.get(st.slot)
        if slot is not None:
            slot.requests.discard(request_id)
            if not slot.requests:
                slot.idle_since = time.monotonic()
        return slot

    def _close_idle(self) -> None:
        """Close the streams of pool replicas no request has used for LINK_IDLE_S (a replica that
        left the pool, or traffic that moved elsewhere): none stays open for nothing."""
        now = time.monotonic()
        for key, slot in list(self._slots.items()):
            if key != PRIVATE and not slot.requests and now - slot.idle_since > LINK_IDLE_S:
                if slot.link is not None:
                    slot.link.close(wait_s=0.5)
                del self._slots[key]

    def stats(self) -> ProposerStats:
        self._stats.extra["links"] = sum(s.link is not None and s.link.alive for s in self._slots.values())
        return self._stats

    def close(self) -> None:
        for slot in self._slots.values():
            if slot.link is not None:
                slot.link.close()
                slot.link = None


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
