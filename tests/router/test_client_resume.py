"""A stream survives its router: two routers in front of one real SmolLM2 worker (in this process, no
Ray); the router carrying several streams is stopped mid-stream (its streams cut, no grace) and the
Duet client (router/client.py) resumes each on the other router at the exact token index
(duet.v1.ResumeFrom). Every stream's tokens and text equal an unbroken run's, greedy and seeded."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from testkit.router_fakes import LoopThread
from testkit.router_kill import assert_like_unbroken, streams_through_a_kill, unbroken_runs

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.client import collect, complete, stream
from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

PROMPTS = ["The old clock in the hallway", "Write a short story about a fox:", "List three rivers of Europe:",
           "My favourite recipe is"]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=11)]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def worker(smollm2_path):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    w = lt.run(start_worker_server(config, worker_id="w0"), timeout=600)
    try:
        yield w
    finally:
        lt.run(w.stop(grace=1))
        lt.close()


def _router(smollm2_path, tok, worker):
    return serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, load_poll_interval_s=0.05),
                        [("w0", worker.endpoint)], tokenizer=tok)


def test_streams_resume_on_another_router_with_identical_output(smollm2_path, tok, worker):
    cases = [(p, s) for p in PROMPTS for s in SAMPLING]  # 8 streams, greedy and seeded
    standby = _router(smollm2_path, tok, worker)
    doomed = _router(smollm2_path, tok, worker)
    try:
        expected = unbroken_runs(cases, standby.address, max_tokens=MAX_TOKENS)
        # the router carrying them dies mid-way: its streams end now
        got, at_kill = streams_through_a_kill(cases, [doomed.address, standby.address], lambda: doomed.stop(0),
                                              max_tokens=MAX_TOKENS, min_seen=2)
        assert_like_unbroken(cases, expected, got, at_kill, max_tokens=MAX_TOKENS, max_diverged=len(cases) // 4 - 1,
                             diverge_before_kill=True)
        stats = standby.stats()["requests"]
        assert stats.get("client_resumes", 0) == len(cases)
    finally:
        doomed.stop(0)
        standby.stop(0)


def test_resume_text_continues_after_held_back_text(smollm2_path, tok, worker):
    """A stop string's possible start is held back: the resumed stream still delivers it once."""
    router = _router(smollm2_path, tok, worker)
    try:
        full = complete("Count: one, two, three,", target=router.address, max_tokens=12, temperature=0.0,
                        ignore_eos=True, timeout=300)
        ids = list(full.token_ids)
        for cut in (1, 4, 7):
            head = collect(stream(token_ids=None, prompt="Count: one, two, three,", target=router.address,
                                  max_tokens=cut, temperature=0.0, ignore_eos=True, timeout=300))
            assert list(head.token_ids) == ids[:cut]
            request = duet_pb2.GenerateRequest(prompt="Count: one, two, three,", sampling=duet_pb2.SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True))
            request.resume.token_ids.extend(ids[:cut])
            request.resume.text_chars = len(head.text)
            with grpc.insecure_channel(router.address) as channel:
                rest = list(duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=300))
            assert ids[:cut] + [t for r in rest for t in r.token_ids] == ids
            assert head.text + "".join(r.text for r in rest) == full.text
            assert rest[-1].usage.completion_tokens == 12
    finally:
        router.stop(0)


@pytest.mark.parametrize("field, change, message", [
    ("n", lambda r: setattr(r, "n", 2), "resume: a request with n > 1 cannot be resumed"),
    ("text_chars", lambda r: setattr(r.resume, "text_chars", 10_000), "resume.text_chars"),
    ("max_tokens", lambda r: setattr(r.sampling, "max_tokens", 2), "resume.token_ids"),
])
def test_bad_resumes_are_refused(smollm2_path, tok, worker, field, change, message):
    router = _router(smollm2_path, tok, worker)
    try:
        request = duet_pb2.GenerateRequest(prompt="Hello", sampling=duet_pb2.SamplingParams(max_tokens=8))
        request.resume.token_ids.extend([tok.encode(" world")[-1], tok.encode(" again")[-1]])
        change(request)
        with grpc.insecure_channel(router.address) as channel, pytest.raises(grpc.RpcError) as e:
            list(duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    finally:
        router.stop(0)


def test_a_draining_router_hands_its_streams_off(smollm2_path, tok, worker):
    """stop(grace) (what SIGTERM runs): no new calls, streams still running at half the grace end with
    the hand-off mark, and the client resumes them on the other router: same tokens, no error."""
    from router import client as client_module
    from router import server as server_module

    assert client_module.HANDOFF_METADATA_KEY == server_module.HANDOFF_METADATA_KEY
    standby = _router(smollm2_path, tok, worker)
    draining = _router(smollm2_path, tok, worker)
    try:
        prompts = PROMPTS[:3]
        expected = unbroken_runs([(p, dict(temperature=0.0)) for p in prompts], standby.address, max_tokens=48)
        got: list = [None] * len(prompts)
        seen = [0] * len(prompts)
        errors: list[str] = []

        def run(i: int) -> None:
            chunks = []
            try:
                # the hand-off ends the stream with UNAVAILABLE + duet-handoff: the client resumes it
                for c in stream(prompts[i], target=[draining.address, standby.address], max_tokens=48,
                                temperature=0.0, ignore_eos=True, timeout=300):
                    chunks.append(c)
                    seen[i] += len(c.token_ids)
                got[i] = collect(chunks)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while min(seen) < 1 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert min(seen) >= 1 and max(seen) < 48, (seen, errors)
        started = time.monotonic()
        draining.stop(grace=1.0)  # hands off at 0.5 s
        assert time.monotonic() - started < 5.0
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert [g.token_ids for g in got] == [e.token_ids for e in expected]
        assert [g.text for g in got] == [e.text for e in expected]
        assert draining.server.servicer.num_handed_off == len(prompts)
        assert standby.stats()["requests"].get("client_resumes", 0) == len(prompts)
    finally:
        draining.stop(0)
        standby.stop(0)
