"""Disaggregation through the worker gRPC service, in process (no Ray): a decode worker given a
Submit with ``remote_prefill`` reserves blocks, calls the prefill worker's Prefill RPC and receives
the KV over the pair's channel (the shared-memory ring: both workers run on this host; gloo
between processes is tests/workers/kv/test_kv_transfer.py's). Output equals the colocated Submit token for token; counters
show the transfers; failures on the prefill side end the call with ABORTED and return every
reserved block."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.server.service import start_worker_server

from tests.workers.engine.test_disagg_engine import LONG
from tests.workers.server.test_worker_service import PROMPTS, run, sampling

from testkit.tolerance import LOGPROB_ACROSS_BATCHES


@pytest.fixture(scope="module")
def pair(loop, smollm2_path):
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    prefill = run(loop, start_worker_server(config, worker_id="prefill-0", kv_transfer_timeout_s=10))
    decode = run(loop, start_worker_server(config, worker_id="decode-0", kv_transfer_timeout_s=10))
    yield prefill, decode
    run(loop, prefill.stop(grace=1))
    run(loop, decode.stop(grace=1))


def remote(server) -> worker_pb2.RemotePrefill:
    return worker_pb2.RemotePrefill(worker_id=server.worker_id, endpoint=server.endpoint,
                                    incarnation=server.incarnation)


async def submit(endpoint: str, rid: str, ids: list[int], params, rp=None) -> tuple[list[int], worker_pb2.Usage]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=params, remote_prefill=rp)
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Submit(req)]
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage


async def load(endpoint: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())


def test_disaggregated_equals_colocated_concurrently(loop, pair, tokenizer):
    prefill, decode = pair
    prompts = [tokenizer.encode(p) for p in [*PROMPTS, LONG]]
    params = [sampling(max_tokens=12), sampling(max_tokens=12, temperature=0.8, top_k=40, seed=5)]

    async def go():
        want = await asyncio.gather(*(submit(decode.endpoint, f"c{i}-{j}", ids, p)
                                      for i, ids in enumerate(prompts) for j, p in enumerate(params)))
        got = await asyncio.gather(*(submit(decode.endpoint, f"d{i}-{j}", ids, p, remote(prefill))
                                     for i, ids in enumerate(prompts) for j, p in enumerate(params)))
        return want, got, await load(prefill.endpoint), await load(decode.endpoint)

    want, got, p_load, d_load = run(loop, go())
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(u.prompt_tokens == len(ids) for (_, u), ids in zip(got, [p for p in prompts for _ in params]))
    n = len(prompts) * len(params)
    assert p_load.kv_transfers_sent == n and d_load.kv_transfers_received == n
    assert p_load.kv_bytes_sent == d_load.kv_bytes_received > 0 and d_load.kv_transfer_seconds > 0
    assert p_load.kv_transfer_failures == d_load.kv_transfer_failures == 0
    assert p_load.kv_blocks_used == d_load.kv_blocks_used == 0 and d_load.num_reserved == 0


def test_penalties_and_logprobs_over_grpc_equal_colocated(loop, pair, tokenizer):
    """The worker proto carries every sampling field, and the first token's logprobs cross from the
    prefill worker (PrefillResponse.first_token_logprob): disaggregated output and logprobs equal
    the colocated Submit's."""
    prefill, decode = pair
    prompts = [tokenizer.encode(p) for p in [PROMPTS[0], LONG]]
    params = [sampling(max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=4,
                       logit_bias={13: 2.0}, top_logprobs=2),
              sampling(max_tokens=10, temperature=0.8, seed=3, min_p=0.05, frequency_penalty=1.0, top_logprobs=0)]

    async def one(rid, ids, p, rp=None):
        async with grpc.aio.insecure_channel(decode.endpoint) as channel:
            req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=p, remote_prefill=rp)
            msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Submit(req)]
        ids_out = [t for m in msgs for t in m.token_ids]
        lps = [(lp.token_id, [t.token_id for t in lp.top_logprobs]) for m in msgs for lp in m.logprobs]
        return ids_out, lps, [lp.logprob for m in msgs for lp in m.logprobs]

    async def go():
        want = [await one(f"pc{i}-{j}", ids, p) for i, ids in enumerate(prompts) for j, p in enumerate(params)]
        got = [await one(f"pd{i}-{j}", ids, p, remote(prefill)) for i, ids in enumerate(prompts)
               for j, p in enumerate(params)]
        return want, got

    want, got = run(loop, go())
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        assert g[2] == LOGPROB_ACROSS_BATCHES.approx(w[2])
    assert all(len(lps) == len(ids) and [t for t, _ in lps] == ids for ids, lps, _ in got)


def test_decode_prefix_hit_sends_fewer_bytes(loop, pair, tokenizer):
    prefill, decode = pair
    shared = "A preface no other test sends. " + LONG
    ids = tokenizer.encode(shared + " Question one?")
    ids2 = tokenizer.encode(shared + " And a different second question?")

    async def go():
        before = (await load(decode.endpoint)).kv_bytes_received
        await submit(decode.endpoint, "p1", ids, sampling(max_tokens=4), remote(prefill))
        mid = (await load(decode.endpoint)).kv_bytes_received
        _, usage = await submit(decode.endpoint, "p2", ids2, sampling(max_tokens=4), remote(prefill))
        after = (await load(decode.endpoint)).kv_bytes_received
        return mid - before, after - mid, usage

    first, second, usage = run(loop, go())
    assert usage.cached_prompt_tokens >= 16 * (len(tokenizer.encode(shared)) // 16) - 16  # decode-side hits
    assert second < first / 2


@pytest.mark.parametrize("breakage", ["stale_incarnation", "dead_endpoint"])
def test_prefill_failure_aborts_and_returns_reserved_blocks(loop, pair, tokenizer, breakage):
    prefill, decode = pair
    rp = remote(prefill)
    if breakage == "stale_incarnation":
        rp.incarnation = "an-older-incarnation"
    else:
        rp.endpoint = "127.0.0.1:1"

    async def go():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(decode.endpoint, f"x-{breakage}", tokenizer.encode(LONG), sampling(max_tokens=4), rp)
        return info.value, await load(decode.endpoint), await load(prefill.endpoint)

    error, d_load, p_load = run(loop, go())
    assert error.code() == grpc.StatusCode.ABORTED and "remote prefill failed" in error.details()
    assert d_load.kv_blocks_used == 0 and d_load.num_reserved == 0
    assert p_load.kv_blocks_used == 0 and p_load.num_running == p_load.num_waiting == 0


def test_a_grammar_without_a_first_token_is_invalid_argument_on_both_routes(loop, pair, tokenizer):
    # the regex (a{0}) admits only the empty string and min_tokens forbids ending there: the first token,
    # computed on the prefill worker when disaggregated, has no allowed value; the client gets the
    # same INVALID_ARGUMENT naming the field either way (not ABORTED, which the router would retry)
    prefill, decode = pair
    params = sampling(max_tokens=4, min_tokens=1, structured=worker_pb2.StructuredOutput(regex="a{0}"))

    async def go(rp):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(decode.endpoint, f"dead-{rp is not None}", tokenizer.encode(LONG), params, rp)
        return info.value

    for rp in (None, remote(prefill)):
        error = run(loop, go(rp))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (rp, error.details())
        assert error.details().startswith("sampling.structured.regex: the grammar admits no token"), error.details()
    d_load, p_load = run(loop, load(decode.endpoint)), run(loop, load(prefill.endpoint))
    assert d_load.kv_blocks_used == 0 and d_load.num_reserved == 0
    assert p_load.kv_blocks_used == 0 and p_load.num_running == p_load.num_waiting == 0
