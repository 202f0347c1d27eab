"""The worker's gRPC service, in process (no Ray): a real engine behind a real grpc.aio server.

One server is shared by the module. Its event loop lives in the ``loop`` fixture and only runs
while a test drives it (``run(loop, coro)``), which is all a server needs when its only clients
are the tests themselves.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.engine.block_manager import BlockStats
from workers.engine.speculator import SpecStats
from workers.config import CacheConfig, EngineConfig
from workers.errors import ModelNotFoundError
from workers.sampling_params import SamplingParams
from workers.engine.loop import LoadSnapshot
from workers.server.service import SERVICE_NAME, EngineLoop, WorkerUnavailableError, start_worker_server

T = TypeVar("T")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Les fleurs du jardin sont",
    "Explain quantum computing in simple terms.",
    "Translate to German: The weather is nice today.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(kv_cache_memory_bytes=64 << 20))


def sampling(**kw) -> worker_pb2.SamplingParams:
    base = dict(max_tokens=16, temperature=0.0, top_p=1.0)
    return worker_pb2.SamplingParams(**(base | kw))


def run(loop: asyncio.AbstractEventLoop, coro: Awaitable[T], timeout: float = 120) -> T:
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def with_stub(loop, server, fn: Callable[[worker_pb2_grpc.WorkerStub], Awaitable[T]]) -> T:
    async def go() -> T:
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            return await fn(worker_pb2_grpc.WorkerStub(channel))

    return run(loop, go())


async def collect(stub, request_id: str, ids: list[int], params: worker_pb2.SamplingParams, **kw):
    msgs = [m async for m in stub.Submit(worker_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=ids, sampling=params), **kw)]
    return [t for m in msgs for t in m.token_ids], msgs


async def read_rest(call) -> list[worker_pb2.SubmitResponse]:
    """The remaining messages of a stream already read with ``call.read()`` (the APIs can't mix)."""
    msgs = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        msgs.append(msg)
    return msgs


async def status_of(call_coro: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_coro
    return info.value


async def wait_idle(stub, timeout: float = 30.0) -> worker_pb2.LoadReport:
    """Poll GetLoad until no request runs or waits and no KV block is held."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = await stub.GetLoad(worker_pb2.GetLoadRequest())
        if (load.num_running, load.num_waiting, load.kv_blocks_used, load.outstanding_tokens) == (0, 0, 0, 0):
            return load
        assert asyncio.get_running_loop().time() < deadline, f"worker never went idle: {load}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def worker(loop, smollm2_path):
    server = run(loop, start_worker_server(engine_config(smollm2_path), worker_id="w-test"), timeout=120)
    yield server
    run(loop, server.stop(grace=0))


def test_greedy_stream_equals_direct_engine(loop, worker, llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    direct = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16))[0]
    tokens, msgs = with_stub(loop, worker, lambda s: collect(s, "greedy", ids, sampling(max_tokens=16)))
    assert tokens == direct.token_ids
    assert all(not m.HasField("finish_reason") for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == {"stop": worker_pb2.FINISH_REASON_STOP,
                                  "length": worker_pb2.FINISH_REASON_LENGTH}[direct.finish_reason.value]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), len(tokens))


def test_concurrent_submits_all_complete(loop, worker, llm):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]

    async def go(stub):
        results = await asyncio.gather(*(collect(stub, f"c{i}", ids, sampling(max_tokens=12, ignore_eos=True))
                                         for i, ids in enumerate(prompts)))
        return results, await wait_idle(stub)

    results, load = with_stub(loop, worker, go)
    for tokens, msgs in results:
        assert len(tokens) == 12 and msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert load.kv_blocks_cached > 0  # finished requests leave their full blocks cached


def test_prefix_cache_hits_show_in_usage_and_load(loop, worker):
    prompt = list(range(500, 540))  # 40 tokens: 2 full blocks of 16 can be reused

    async def go(stub):
        before = await stub.GetLoad(worker_pb2.GetLoadRequest())
        _, first = await collect(stub, "pc1", prompt, sampling(max_tokens=1))
        _, second = await collect(stub, "pc2", prompt, sampling(max_tokens=1))
        return before, first[-1].usage, second[-1].usage, await stub.GetLoad(worker_pb2.GetLoadRequest())

    before, first, second, after = with_stub(loop, worker, go)
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 32)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits == 2 and after.prefix_cache_queries - before.prefix_cache_queries > hits  # + pc1's miss


def test_watch_blocks_pushes_a_prompt_onto_the_device_and_leaves_nothing_pending(loop, worker):
    from workers.block_hash import Tier, chain_hashes

    prompt = list(range(700, 748))  # 3 full blocks, new to this worker

    async def go(stub):
        watch = stub.WatchBlocks(worker_pb2.GetLoadRequest(block_events=True))
        first = await asyncio.wait_for(watch.read(), 30)  # a snapshot (no cursor)
        hashes = set(chain_hashes(prompt, first.kv_block_size))
        tiers: dict[int, int] = {}
        submit = asyncio.ensure_future(collect(stub, "watched", prompt, sampling(max_tokens=2)))
        while not (len(tiers) == len(hashes) and set(tiers.values()) == {Tier.DEVICE}):
            msg = await asyncio.wait_for(watch.read(), 30)
            assert not msg.block_snapshot and msg.incarnation == first.incarnation
            for h, t in zip(msg.blocks_stored, list(msg.blocks_stored_tiers) or [0] * len(msg.blocks_stored)):
                if h in hashes:
                    tiers[h] = t
        await submit
        # a request cancelled right after admission (before or after its first token) leaves nothing pending
        call = stub.Submit(worker_pb2.SubmitRequest(request_id="cancel-early", prompt_token_ids=list(range(800, 848)),
                                                    sampling=sampling(max_tokens=50, ignore_eos=True)))
        await asyncio.sleep(0.01)
        call.cancel()
        await wait_idle(stub)
        watch.cancel()
        return first, hashes

    first, hashes = with_stub(loop, worker, go)
    assert first.block_snapshot and first.kv_block_size > 0 and len(hashes) == 3
    assert len(worker.servicer.pending) == 0
    events = worker.limits.block_events
    assert all(events.tier(h) is Tier.DEVICE for h in hashes)
    assert not [h for h in chain_hashes(list(range(800, 848)), first.kv_block_size) if events.tier(h) is Tier.PENDING]


def test_cancel_mid_stream_frees_every_kv_block(loop, worker):
    async def go(stub):
        call = stub.Submit(worker_pb2.SubmitRequest(
            request_id="cancel-me", prompt_token_ids=list(range(100, 140)),
            sampling=sampling(max_tokens=400, ignore_eos=True)))
        got = 0
        async for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                break
        busy = await stub.GetLoad(worker_pb2.GetLoadRequest())
        call.cancel()
        return busy, await wait_idle(stub), await stub.Abort(worker_pb2.AbortRequest(request_id="cancel-me"))

    busy, idle, abort = with_stub(loop, worker, go)
    assert busy.num_running == 1 and busy.kv_blocks_used > 0
    assert 0 < busy.outstanding_tokens <= 40 + 400 - 1 - 40 - 2  # P + M - 1 - C, with C >= P + 2
    assert idle.kv_blocks_used == 0 and idle.num_running == 0
    assert not abort.found  # already gone from the engine


def test_expired_deadline_frees_every_kv_block(loop, worker):
    async def go(stub):
        err = await status_of(collect(stub, "slow", list(range(200, 230)),
                                      sampling(max_tokens=1000, ignore_eos=True), timeout=1.0))
        return err, await wait_idle(stub)

    err, idle = with_stub(loop, worker, go)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert idle.kv_blocks_used == 0 and idle.num_running == 0


def test_abort_rpc_ends_stream_with_abort(loop, worker):
    async def go(stub):
        call = stub.Submit(worker_pb2.SubmitRequest(
            request_id="to-abort", prompt_token_ids=list(range(300, 320)),
            sampling=sampling(max_tokens=400, ignore_eos=True)))
        first = await call.read()
        found = (await stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"))).found
        rest = await read_rest(call)
        unknown = (await stub.Abort(worker_pb2.AbortRequest(request_id="never-submitted"))).found
        return first, found, rest, unknown, await wait_idle(stub)

    first, found, rest, unknown, _ = with_stub(loop, worker, go)
    assert len(first.token_ids) >= 1 and found and not unknown
    assert rest[-1].finish_reason == worker_pb2.FINISH_REASON_ABORT
    assert rest[-1].usage.completion_tokens == len(first.token_ids) + sum(len(m.token_ids) for m in rest)


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"seed": 2**63}, "seed"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_invalid_argument(loop, worker, kw, field):
    err = with_stub(loop, worker, lambda s: status_of(collect(s, "bad", [1, 2, 3], sampling(**kw))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in err.details()


def test_bad_prompts_invalid_argument(loop, worker):
    long_prompt = [7] * worker.limits.max_model_len

    async def go(stub):
        return [await status_of(collect(stub, "p", ids, sampling())) for ids in ([], long_prompt, [1, 10**6])]

    for err in with_stub(loop, worker, go):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.details()


def test_duplicate_in_flight_id_already_exists(loop, worker):
    async def go(stub):
        call = stub.Submit(worker_pb2.SubmitRequest(request_id="dup", prompt_token_ids=[1, 2, 3],
                                                    sampling=sampling(max_tokens=400, ignore_eos=True)))
        await call.read()
        err = await status_of(collect(stub, "dup", [4, 5, 6], sampling()))
        call.cancel()
        await wait_idle(stub)
        again, _ = await collect(stub, "dup", [4, 5, 6], sampling(max_tokens=2))  # free again
        return err, again

    err, again = with_stub(loop, worker, go)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.details()
    assert len(again) == 2


def test_full_queue_resource_exhausted(loop, worker):
    worker.servicer.max_inflight = 0
    try:
        err = with_stub(loop, worker, lambda s: status_of(collect(s, "x", [1, 2], sampling())))
    finally:
        worker.servicer.max_inflight = 1024
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_serving_and_load_identity(loop, worker):
    async def go():
        async with grpc.aio.insecure_channel(worker.endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            statuses = [(await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                        for name in ("", SERVICE_NAME)]
            return statuses, await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())

    statuses, load = run(loop, go())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert load.worker_id == "w-test" and len(load.incarnation) == 32
    assert load.kv_block_size == 16 and load.kv_blocks_total > 0


def test_outstanding_tokens_follows_the_proto_definition(llm):
    engine = llm.engine
    engine.add_request("o1", list(range(400, 420)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    try:
        assert LoadSnapshot.of(engine).outstanding_tokens == 20 + 10 - 1  # nothing computed yet
        engine.step()  # the whole prompt is computed and one token sampled: C = 20
        snap = LoadSnapshot.of(engine)
        assert (snap.num_running, snap.outstanding_tokens) == (1, 20 + 10 - 1 - 20)
        engine.step()  # one decode step: C = 21
        assert LoadSnapshot.of(engine).outstanding_tokens == 8
    finally:
        engine.abort("o1")
    assert LoadSnapshot.of(engine).outstanding_tokens == 0


def test_stop_aborts_in_flight_with_unavailable_and_leaves_no_threads(loop, worker, smollm2_path):
    # `worker` is requested so gRPC's process-wide poller thread already runs before the baseline.
    before = set(threading.enumerate())

    async def go():
        server = await start_worker_server(engine_config(smollm2_path), worker_id="w-stop")
        assert set(threading.enumerate()) - before  # the engine thread
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            call = stub.Submit(worker_pb2.SubmitRequest(request_id="long", prompt_token_ids=[1, 2, 3],
                                                        sampling=sampling(max_tokens=1000, ignore_eos=True)))
            await call.read()
            stopping = asyncio.ensure_future(server.stop(grace=1.5))
            await asyncio.sleep(0.05)  # draining (for 1.5 s): health says NOT_SERVING, new work is refused
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            refused = await status_of(collect(stub, "late", [1, 2], sampling()))
            stream_err = await status_of(read_rest(call))
            await stopping
        return health.status, refused, stream_err

    status, refused, stream_err = run(loop, go())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert stream_err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in stream_err.details()
    assert set(threading.enumerate()) <= before  # nothing new (a pool thread of before may have ended since)


class ExplodingEngine:
    """Just enough Engine for EngineLoop: accepts requests, then fails its first step."""

    max_model_len, spec = 64, SimpleNamespace(vocab_size=100)
    block_manager, scheduler = SimpleNamespace(block_size=16, enable_prefix_caching=False), SimpleNamespace(running=[], waiting=[])
    config = SimpleNamespace(device="cpu")
    adapters = None  # no LoRA

    def __init__(self) -> None:
        self.pending: list[str] = []

    def stats(self):
        return SimpleNamespace(num_running=0, num_waiting=len(self.pending), num_preemptions=0,
                               blocks=BlockStats(4, 4, 0, 0, 0), expert_tokens=(), ep_rank_tokens=(),
                               num_reserved=0, spec=SpecStats(), tiers=None)

    def kv_layout(self) -> None:
        return None  # no KV transfer

    def reserved(self) -> list:
        return []

    def add_request(self, request_id, prompt, params, export_from_block=None, resumed_output_tokens=0, adapter=None) -> None:
        self.pending.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self):
        raise RuntimeError("boom")


def test_engine_failure_fails_every_stream_and_later_request():
    before = set(threading.enumerate())

    async def go():
        engine = EngineLoop(ExplodingEngine, asyncio.get_running_loop())
        await engine.start()
        first, later = asyncio.Queue(), asyncio.Queue()
        engine.add("a", [1], SamplingParams(), first)
        failed = await asyncio.wait_for(first.get(), 10)  # never hangs
        error = await engine.wait_closed()
        engine.add("b", [1], SamplingParams(), later)  # after the thread is gone: answered at once
        return failed, error, later.get_nowait(), await engine.abort("a")

    failed, error, later, found = asyncio.run(go())
    assert isinstance(failed, WorkerUnavailableError) and "boom" in str(failed)
    assert isinstance(error, RuntimeError) and isinstance(later, WorkerUnavailableError) and not found
    assert set(threading.enumerate()) <= before  # nothing new (a pool thread of before may have ended since)


def test_engine_load_failure_raises_from_start():
    def broken() -> ExplodingEngine:
        raise ModelNotFoundError("model 'nope' not found")

    async def go():
        with pytest.raises(ModelNotFoundError, match="nope"):
            await EngineLoop(broken, asyncio.get_running_loop()).start()

    before = set(threading.enumerate())
    asyncio.run(go())
    assert set(threading.enumerate()) <= before  # nothing new (a pool thread of before may have ended since)
