"""``n`` and logprobs through the router in front of one real SmolLM2 worker (in this process, no
Ray): n=4 with a seed reproduces choice by choice, choice 0 is the n=1 answer, the choices after
the first reuse its prompt from the worker's prefix cache, and every token carries its logprobs."""

from __future__ import annotations

import grpc
import pytest
from testkit.router_fakes import LoopThread

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router
from workers.config import CacheConfig, EngineConfig
from workers.server.service import start_worker_server

PROMPT = ("A lighthouse keeper lived alone on a small island in the north sea. Every evening he climbed the "
          "stairs, wound the clockwork and lit the lamp, and every morning he wrote one line in his log. ") * 2


@pytest.fixture(scope="module")
def stub(smollm2_path, tok):
    lt = LoopThread()
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
    worker = lt.run(start_worker_server(config, worker_id="w0"), timeout=600)  # a first kernel build can be slow
    router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, policy="prefix_aware",
                                       load_poll_interval_s=0.1), [("w0", worker.endpoint)], tokenizer=tok)
    try:
        with grpc.insecure_channel(router.address) as channel:
            yield duet_pb2_grpc.DuetStub(channel)
    finally:
        router.stop(0)
        lt.run(worker.stop(grace=1))
        lt.close()


def _choices(stub, **kw) -> dict[int, list[duet_pb2.GenerateResponse]]:
    out: dict[int, list] = {}
    for r in stub.Generate(duet_pb2.GenerateRequest(prompt=PROMPT, **kw), timeout=120):
        out.setdefault(r.index, []).append(r)
    return out


def test_n4_with_seed_reproduces_and_shares_the_prompt(stub, tok):
    sampling = duet_pb2.SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, top_logprobs=2)
    first = _choices(stub, n=4, sampling=sampling)
    again = _choices(stub, n=4, sampling=sampling)
    ids = {i: [t for m in msgs for t in m.token_ids] for i, msgs in first.items()}
    assert sorted(ids) == [0, 1, 2, 3] and all(len(v) == 10 for v in ids.values())
    assert ids == {i: [t for m in msgs for t in m.token_ids] for i, msgs in again.items()}
    assert len({tuple(v) for v in ids.values()}) > 1  # different seeds, different samples
    [single] = _choices(stub, sampling=sampling).values()
    assert [t for m in single for t in m.token_ids] == ids[0]  # choice 0 is the n=1 answer
    prompt_len = len(tok.encode(PROMPT))
    for i, msgs in first.items():
        usage = msgs[-1].usage
        assert usage.prompt_tokens == prompt_len and usage.completion_tokens == 10
        lps = [lp for m in msgs for lp in m.logprobs]
        assert [lp.token_id for lp in lps] == ids[i] and all(len(lp.top_logprobs) == 2 for lp in lps)
        assert all(lp.logprob <= 0 for lp in lps)
        if i:  # sent after choice 0's prompt was computed: its full blocks come from the prefix cache
            assert usage.cached_prompt_tokens >= prompt_len // 16 * 16 - 16
