"""Target engines drafting on shared drafter replicas (a drafter pool, in one process): two targets
share one replica (their rounds batched together), one target's requests use two replicas (M:N), a
request migrated between targets keeps its drafter state (nothing recomputed there), and a replica
that dies mid-generation, or stalls, only costs drafts: every output equals plain greedy decoding,
the fallbacks are counted, the link comes back once the replica does, and nothing is left on the
drafters (requests, KV blocks, streams)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from workers.build import build_engine
from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from workers.engine.engine import Engine
from workers.engine.proposer import DrafterRef
from workers.engine.sequence import FinishReason
from workers.sampling_params import SamplingParams
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.drafter import DraftEngine
from workers.spec_decode.drafter_service import serve_drafter

from testkit.waiting import wait_until

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Repeat exactly: red green blue red green blue red green blue red green",
           "<|im_start|>user\nCopy this list: apples, pears, plums, apples, pears, plums<|im_end|>\n"
           "<|im_start|>assistant\n",
           "The capital of France is"]
POOL = SpeculativeConfig(method="draft_model", drafter_pool="drafters", num_speculative_tokens=4, adaptive=False)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def target(path: Path, spec: SpeculativeConfig | None = POOL, timeout_s: float = 30.0) -> Engine:
    config = EngineConfig(model=str(path), cache=CacheConfig(kv_cache_memory_bytes=24 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=128),
                          speculative=spec or SpeculativeConfig())
    proposer = DraftModelProposer(None, timeout_s=timeout_s, vocab_limit=49152) if spec else None
    return build_engine(config, proposer=proposer)


def drafter(path: Path, **kw):
    engine = DraftEngine(EngineConfig(model=str(path), quantization="int8",
                                      cache=CacheConfig(kv_cache_memory_bytes=16 << 20)))
    server, endpoint = serve_drafter(engine, **kw)
    return engine, server, DrafterRef(f"drafters-{endpoint}", endpoint)


def run(engine: Engine, prompts: list[list[int]], n: int, drafters: list[DrafterRef | None], tag: str = "r",
        on_step=None) -> list[list[int]]:
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, ids, d in zip(rids, prompts, drafters):
        if engine.speculator is not None:
            engine.speculator.assign(rid, d)
        engine.add_request(rid, ids, greedy(n))
    out = {rid: [] for rid in rids}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
        if on_step is not None:
            on_step(steps)
    stats = engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "target KV blocks leaked"
    return [out[r] for r in rids]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path, prompts):
    plain = target(smollm2_path, spec=None)
    return run(plain, prompts, 32, [None] * len(prompts))


@pytest.fixture(scope="module")
def targets(smollm2_path):
    a, b = target(smollm2_path), target(smollm2_path)
    yield a, b
    for e in (a, b):
        e.speculator.close()


def _clean(*engines: DraftEngine) -> None:
    for e in engines:
        wait_until(lambda e=e: e.num_requests == 0, timeout=10, what="drafter requests released")
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks, "drafter KV blocks leaked"


def test_two_targets_share_one_replica(smollm2_path, targets, prompts, reference):
    engine, server, ref = drafter(smollm2_path)
    a, b = targets
    try:
        got: dict[str, list[list[int]]] = {}
        threads = [threading.Thread(target=lambda e=e, t=t: got.__setitem__(t, run(e, prompts, 32, [ref] * 4, t)))
                   for e, t in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert got["a"] == reference and got["b"] == reference
        assert server.servicer.num_streams == 2  # one stream per (target, drafter) pair
        s = engine.stats()
        assert s.batched_rows > s.forward_passes  # rounds shared forward passes
        for e in (a, b):
            spec = e.stats().spec
            assert spec.num_accepted_tokens > 0 and spec.num_fallbacks == 0
        _clean(engine)
    finally:
        for e in (a, b):
            e.speculator.proposer.close()
        server.stop()
    assert server.servicer.num_streams == 0


def test_one_target_uses_two_replicas(smollm2_path, targets, prompts, reference):
    (e0, s0, r0), (e1, s1, r1) = drafter(smollm2_path), drafter(smollm2_path)
    a, _ = targets
    try:
        assert run(a, prompts, 32, [r0, r1, r0, r1], "m") == reference
        assert e0.stats().items > 0 and e1.stats().items > 0
        assert s0.servicer.num_streams == 1 and s1.servicer.num_streams == 1
        assert a.speculator.proposer.stats().extra["links"] >= 2
        _clean(e0, e1)
    finally:
        a.speculator.proposer.close()
        s0.stop()
        s1.stop()


def test_a_migrated_request_keeps_its_drafter_state(smollm2_path, targets, prompts, reference):
    """Target a runs the request, b takes it over mid-stream (live migration): b drafts on the same
    replica from its first step, which keeps what it holds for the request: the drafter computes
    what it computes for the unmigrated run, give or take overlapped windows, not the context again."""
    a, b = targets
    engine, server, ref = drafter(smollm2_path)
    try:
        before = engine.stats().tokens_computed
        assert run(a, prompts[:1], 32, [ref], "u") == reference[:1]
        unmigrated = engine.stats().tokens_computed - before

        a.speculator.assign("g", ref)
        a.add_request("g", prompts[0], greedy(32))
        out: list[int] = []
        before = engine.stats().tokens_computed
        while len(out) < 12:
            for o in a.step():
                out += o.new_token_ids
        snap = a.pause_request("g")
        assert snap.drafter == ref
        ticket = b.reserve_migration(snap)
        b.import_migration("g", ticket, a.migration_kv("g", ticket.first_block), snap)
        assert a.finish_migrated("g").finish_reason is FinishReason.MIGRATED
        while b.has_unfinished():
            for o in b.step():
                out += o.new_token_ids
        assert out == reference[0]
        # the same drafts were made either way, so the drafter computed the same tokens but for the
        # source's overlapped window (k + 1) that the move discarded and, in either run, how much of
        # the last overlapped window it computed before the release arrived (up to k + 1); a drafter
        # starting afresh on b would have recomputed the prompt and the 12 tokens again
        migrated = engine.stats().tokens_computed - before
        assert migrated <= unmigrated + 3 * (4 + 1) < unmigrated + len(prompts[0]) + 12
        assert b.stats().spec.num_accepted_tokens > 0
        _clean(engine)
    finally:
        for e in (a, b):
            e.speculator.proposer.close()
        server.stop()


def test_a_replica_killed_mid_stream_costs_drafts_not_tokens(smollm2_path, targets, prompts, reference):
    """The replica stops while four requests draft there: they continue without drafts (fallbacks
    counted), output unchanged; a replica back at the same endpoint is re-attached (its requests
    resend their whole contexts) and drafting resumes."""
    a, _ = targets
    engine, server, ref = drafter(smollm2_path)
    port = int(ref.endpoint.rsplit(":", 1)[1])
    proposer = a.speculator.proposer
    before = proposer.stats().fallbacks
    restarted: list = []

    def kill_then_restart(step: int) -> None:
        if step == 3:
            server.stop()
        if step == 8:  # "Ray restarted it": a fresh replica (empty state) on the same port
            restarted.append(serve_drafter(DraftEngine(EngineConfig(
                model=str(smollm2_path), quantization="int8", cache=CacheConfig(kv_cache_memory_bytes=16 << 20))),
                port=port))
            time.sleep(1.2)  # past the reconnect interval

    try:
        assert run(a, prompts, 32, [ref] * 4, "k", kill_then_restart) == reference
        stats = proposer.stats()
        assert stats.fallbacks > before and stats.reattaches >= 1
        new_server, _ = restarted[0]
        assert new_server.scheduler.engine.stats().draft_tokens > 0  # drafting resumed on the new replica
        _clean(new_server.scheduler.engine)
    finally:
        proposer.close()
        for s, _ in restarted:
            s.stop()


class _Stall:
    """Wraps a DraftEngine: its step sleeps ``seconds`` while ``on`` is set (a replica that stalls)."""

    def __init__(self, engine: DraftEngine, seconds: float) -> None:
        self.engine, self.seconds, self.on = engine, seconds, threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        if self.on.is_set():
            time.sleep(self.seconds)
        return self.engine.step()


def test_a_stalled_replica_is_dropped_for_the_step_without_stalling_the_target(smollm2_path, prompts, reference):
    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                      cache=CacheConfig(kv_cache_memory_bytes=16 << 20)))
    # a round may take this long (the first one prefills on the drafter, on a core the rest of the
    # suite shares: 0.3 s was seen missed before any stall); the stall is well past it
    stall = _Stall(engine, 2.5)
    server, endpoint = serve_drafter(stall)
    ref = DrafterRef("drafters-0", endpoint)
    t = target(smollm2_path, timeout_s=1.0)
    try:
        def stall_some(step: int) -> None:
            if step == 2:
                stall.on.set()
            if step == 5:
                stall.on.clear()

        assert run(t, prompts[:2], 24, [ref, ref], "st", stall_some) == [r[:24] for r in reference[:2]]
        assert t.speculator.proposer.stats().fallbacks > 0
        assert t.stats().spec.num_accepted_tokens > 0
    finally:
        t.speculator.close()
        server.stop()
