"""The drafter as a Ray actor (what a deployment runs): the engine builds it from its config, greedy
output equals plain decoding, and killing the drafter mid-generation degrades to plain decoding
(output still exact), then the restarted drafter is re-attached and drafts again. A stalled drafter
(slower than draft_timeout_s) is dropped for the step without stalling the target."""

from __future__ import annotations

import time

import pytest
import ray

from workers.build import build_engine
from workers.config import CacheConfig, EngineConfig, SpeculativeConfig
from workers.engine.engine import Engine
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.drafter import DraftResult
from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter
from workers.engine.proposer import DraftAsk

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "<|im_start|>user\nCopy this list: apples, pears, plums, apples, pears, plums<|im_end|>\n"
           "<|im_start|>assistant\n"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_engine(ray_cluster, smollm2_path):
    spec = SpeculativeConfig(method="draft_model", draft_model=str(smollm2_path), draft_quantization="int8",
                             num_speculative_tokens=4, draft_timeout_s=30.0,
                             adaptive=False)  # always draft: these tests are about the drafter's lifecycle
    # draft_timeout_s: generous, so a round on a machine loaded by the rest of the suite is never
    # dropped as stalled (a kill closes the link at once; stalls have their own test below)
    engine = build_engine(EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
                                             speculative=spec))
    yield engine
    actor = engine.speculator.proposer.actor
    engine.speculator.close()
    ray.kill(actor)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = LLM(str(smollm2_path), kv_cache_memory_bytes=32 << 20)
    return {n: [c.token_ids for c in llm.generate(PROMPTS, greedy(n))] for n in (24, 64)}


def generate(engine: Engine, n: int, on_step=None) -> list[list[int]]:
    ids = [engine.add_request(None, p, greedy(n)) for p in PROMPTS]
    out = {r: [] for r in ids}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
        if on_step is not None:
            on_step(steps)
    return [out[r] for r in ids]


def test_drafter_actor_greedy_equals_plain(spec_engine, reference):
    assert generate(spec_engine, 24) == reference[24]
    s = spec_engine.stats().spec
    assert s.num_verifies > 0 and s.num_accepted_tokens > 0 and s.num_fallbacks == 0


def test_killing_the_drafter_mid_generation_keeps_output_exact(spec_engine, reference):
    actor = spec_engine.speculator.proposer.actor
    before = spec_engine.stats().spec

    def kill_once(step: int) -> None:
        if step == 4:
            ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1)

    assert generate(spec_engine, 64, kill_once) == reference[64]
    mid = spec_engine.stats().spec
    assert mid.num_fallbacks > before.num_fallbacks  # steps went on without drafts
    # the restarted drafter is re-attached (the proposer polls it without blocking the target)
    deadline = time.monotonic() + 120
    while spec_engine.speculator.proposer.stats().reattaches == 0 and time.monotonic() < deadline:
        generate(spec_engine, 8)
        time.sleep(0.2)
    assert spec_engine.speculator.proposer.stats().reattaches >= 1
    assert generate(spec_engine, 24) == reference[24]
    assert spec_engine.stats().spec.num_verifies > mid.num_verifies  # drafting again


class _StallingEngine:
    """A DraftEngine stand-in (what the drafter's scheduler drives): each pass completes every queued
    item with drafts of 7s; passes number ``stall`` (1-based) take 1.5 s."""

    def __init__(self, stall: tuple[int, ...] = (1,)) -> None:
        self.passes = 0
        self.stall = stall
        self._queued: list[DraftResult] = []

    def add(self, item):
        res = DraftResult(item.request_id, [7] * item.num_tokens)
        self._queued.append(res)
        return res

    @property
    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self):
        self.passes += 1
        if self.passes in self.stall:
            time.sleep(1.5)
        done, self._queued = self._queued, []
        for res in done:
            res.done = True
        return done

    def release(self, request_id):
        pass

    def expire(self, idle_s):
        return 0


def test_a_stalled_drafter_is_dropped_and_reattached():
    server, endpoint = serve_drafter(_StallingEngine())
    try:
        prop = DraftModelProposer(endpoint_connector(endpoint), timeout_s=0.3, overlap=False)
        ask = DraftAsk("r", [1, 2, 3], 3, greedy(8))
        t0 = time.monotonic()
        assert prop.propose([ask]) == {}  # timed out: no drafts, the step goes on
        assert time.monotonic() - t0 < 1.0
        assert prop.stats().fallbacks == 1
        time.sleep(1.6)  # the reconnect interval (and the stalled call) pass
        drafts = prop.propose([ask])
        assert drafts["r"].token_ids == [7, 7, 7] and prop.stats().reattaches == 1
        prop.close()
    finally:
        server.stop(grace=0)


def test_drafter_lost_during_an_overlapped_call_falls_back_cleanly():
    """The drafter goes away while the overlapped (next-window) call is in flight: the step gets no
    drafts (no exception reaches the engine) and the failure counts as a fallback."""
    server, endpoint = serve_drafter(_StallingEngine(stall=(2,)))  # pass 2 = the overlapped round
    prop = DraftModelProposer(endpoint_connector(endpoint), timeout_s=5.0, overlap=True)
    first = prop.propose([DraftAsk("r", [1, 2, 3], 3, greedy(8))])
    assert first["r"].token_ids == [7, 7, 7]  # and the next window is being drafted meanwhile
    server.stop(grace=0)  # cancels the overlapped call mid-way
    assert prop.propose([DraftAsk("r", [1, 2, 3, 7, 5], 3, greedy(8))]) == {}
    assert prop.stats().fallbacks == 1
    prop.close()
