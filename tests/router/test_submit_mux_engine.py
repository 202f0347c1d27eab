"""The router's multiplexed worker stream (router/submit_mux.py, workers/server/submit_stream.py)
against its plain path (one Submit call per request), both routers in front of the same real
SmolLM2 worker (in this process, no Ray): the same tokens, logprobs, usage and statuses, concurrent
streams included, and nothing left behind on the worker or in the router afterwards (cancelled
requests included)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from testkit.router_fakes import LoopThread

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

PROMPTS = ["The old lighthouse keeper climbed the stairs and", "def fibonacci(n):\n    ", "Paris is the capital of"]


@pytest.fixture(scope="module")
def deployment(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    worker = lt.run(start_worker_server(config, worker_id="w0"), timeout=600)
    routers = {mux: serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0,
                                              load_poll_interval_s=0.1, multiplex_worker_streams=mux),
                                 [("w0", worker.endpoint)], tokenizer=tok) for mux in (True, False)}
    channels = {mux: grpc.insecure_channel(r.address) for mux, r in routers.items()}
    try:
        yield worker, routers, {mux: duet_pb2_grpc.DuetStub(c) for mux, c in channels.items()}
    finally:
        for c in channels.values():
            c.close()
        for r in routers.values():
            r.stop(0)
        lt.run(worker.stop(grace=1))
        lt.close()


def _generate(stub, prompt: str, **sampling) -> tuple[list[int], list[tuple[int, float]], str, duet_pb2.Usage, int]:
    ids, lps, text = [], [], []
    last = None
    for r in stub.Generate(duet_pb2.GenerateRequest(prompt=prompt, sampling=duet_pb2.SamplingParams(**sampling)),
                           timeout=120):
        ids += r.token_ids
        lps += [(lp.token_id, lp.logprob) for lp in r.logprobs]
        text.append(r.text)
        last = r
    assert last is not None
    return ids, lps, "".join(text), last.usage, last.finish_reason


def _idle(worker, routers) -> None:
    """Nothing left: no request on the worker, none waiting on a router's stream."""
    deadline = time.monotonic() + 10
    while True:
        waiting = [r.server.directory.open_stream_requests() for r in routers.values()]
        if worker.servicer.num_inflight == 0 and not any(waiting):
            return
        assert time.monotonic() < deadline, (worker.servicer.num_inflight, waiting)
        time.sleep(0.02)


def test_same_outputs_as_the_plain_path_alone_and_concurrent(deployment):
    worker, routers, stubs = deployment
    greedy = dict(max_tokens=8, temperature=0.0, top_logprobs=2)
    seeded = dict(max_tokens=8, temperature=1.0, seed=7, top_logprobs=1)
    reference = {}
    for prompt in PROMPTS:  # alone: every field of the result
        for sampling in (greedy, seeded):
            plain = _generate(stubs[False], prompt, **sampling)
            assert _generate(stubs[True], prompt, **sampling) == plain
            if sampling is greedy:
                reference[prompt] = plain[0]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # several streams on the one worker stream
        got = dict(zip(PROMPTS, pool.map(lambda p: _generate(stubs[True], p, **greedy)[0], PROMPTS)))
    assert got == reference
    assert worker.servicer.submit_streams.open_streams == 1  # the multiplexed router's one stream
    _idle(worker, routers)


def test_statuses_and_cancellation_match_and_leave_nothing(deployment, tok):
    worker, routers, stubs = deployment
    too_long = "word " * 5000  # past the context: INVALID_ARGUMENT naming the field
    errors = {}
    for mux, stub in stubs.items():
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub, too_long, max_tokens=4)
        errors[mux] = (e.value.code(), e.value.details())
    assert errors[True] == errors[False] and errors[True][0] == grpc.StatusCode.INVALID_ARGUMENT
    for stub in stubs.values():  # the client goes away mid-stream: the worker aborts and frees the request
        call = stub.Generate(duet_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=duet_pb2.SamplingParams(
            max_tokens=400, temperature=0.0, ignore_eos=True)), timeout=120)
        next(call)
        call.cancel()
    _idle(worker, routers)
    assert worker.servicer.submit_streams.open_streams == 1  # the stream outlives its requests

