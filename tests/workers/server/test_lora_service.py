"""LoRA at the worker service, in process: two workers over the tiny random Llama with LoRA on.

Submit with an adapter loads it on first use (from AdapterRef.source) and equals PEFT's merged
model; LoadAdapter / UnloadAdapter / ListAdapters at runtime while another request streams (the
stream is not dropped, an adapter in use cannot be unloaded); GetLoad reports the adapters; the
status codes of worker.proto; P/D (the prefill worker loads the adapter and computes under it) and
live migration (the target loads it) give the same tokens as one worker.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from testkit.lora_cases import merged_greedy
from testkit.tiny_families import PROMPTS
from tests.workers.server.test_worker_service import run, sampling
from workers.config import CacheConfig, EngineConfig, LoraConfig
from workers.server.service import start_worker_server

N = 12


@pytest.fixture(scope="module")
def pair(loop, tiny_llama: Path):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=256, block_size=8),
                          lora=LoraConfig(enabled=True, max_loaded=2, max_rank=16))
    a = run(loop, start_worker_server(config, worker_id="lora-a", kv_transfer_timeout_s=10,
                                      migration_attach_timeout_s=5.0))
    b = run(loop, start_worker_server(config, worker_id="lora-b", kv_transfer_timeout_s=10,
                                      migration_attach_timeout_s=5.0))
    yield a, b
    run(loop, a.stop(grace=1))
    run(loop, b.stop(grace=1))


def ref(name: str, path: Path) -> worker_pb2.AdapterRef:
    return worker_pb2.AdapterRef(name=name, source=str(path))


async def call(endpoint: str, method: str, request):
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await getattr(worker_pb2_grpc.WorkerStub(channel), method)(request)


async def submit(endpoint: str, rid: str, ids: list[int], params, **fields) -> list[int]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=params, **fields)
        return [t async for m in worker_pb2_grpc.WorkerStub(channel).Submit(req) for t in m.token_ids]


async def code_of(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code(), info.value.details()


async def clean(*servers) -> None:
    for s in servers:
        r = await call(s.endpoint, "GetLoad", worker_pb2.GetLoadRequest())
        assert r.kv_blocks_used == 0 and r.num_running == 0 and r.num_reserved == 0, r
        listed = await call(s.endpoint, "ListAdapters", worker_pb2.ListAdaptersRequest())
        assert all(a.in_use == 0 for a in listed.adapters), listed


def test_submit_loads_on_first_use_and_matches_peft(loop, pair, tiny_llama, tiny_adapters) -> None:
    a, _ = pair
    want = merged_greedy(tiny_llama, tiny_adapters["all8"], PROMPTS, N)
    params = sampling(max_tokens=N, ignore_eos=True)

    async def go():
        got = [await submit(a.endpoint, f"first{i}", p, params, adapter=ref("all8", tiny_adapters["all8"]))
               for i, p in enumerate(PROMPTS)]
        report = await call(a.endpoint, "GetLoad", worker_pb2.GetLoadRequest())
        listed = await call(a.endpoint, "ListAdapters", worker_pb2.ListAdaptersRequest())
        await clean(a)
        return got, report, listed

    got, report, listed = run(loop, go())
    assert got == want
    assert "all8" in report.adapters and report.max_loaded_adapters == 2
    [info] = [x for x in listed.adapters if x.name == "all8"]
    assert info.rank == 8 and info.in_use == 0 and info.bytes > 0 and list(info.target_modules)[:2] == ["q_proj",
                                                                                                       "k_proj"]


def test_load_and_unload_at_runtime_while_a_stream_runs(loop, pair, tiny_llama, tiny_adapters) -> None:
    a, _ = pair
    long = sampling(max_tokens=160, ignore_eos=True)
    qv4 = ref("qv4", tiny_adapters["qv4"])

    async def go():
        want = await submit(a.endpoint, "alone", PROMPTS[0], long, adapter=qv4)
        async with grpc.aio.insecure_channel(a.endpoint) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stream = stub.Submit(worker_pb2.SubmitRequest(request_id="streaming", prompt_token_ids=PROMPTS[0],
                                                          sampling=long, adapter=qv4))
            first = await stream.read()
            busy = await code_of(stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="qv4")))
            info = await stub.LoadAdapter(worker_pb2.LoadAdapterRequest(
                adapter=ref("mlp16", tiny_adapters["mlp16"]), pin=True))
            mid = await submit(a.endpoint, "beside", PROMPTS[1], sampling(max_tokens=N, ignore_eos=True),
                               adapter=worker_pb2.AdapterRef(name="mlp16"))
            await stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name="mlp16"))
            tokens = list(first.token_ids)
            while (m := await stream.read()) is not grpc.aio.EOF:
                tokens += m.token_ids
        await call(a.endpoint, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name="qv4"))  # idle now
        await clean(a)
        return want, tokens, busy, info, mid

    want, tokens, busy, info, mid = run(loop, go())
    assert tokens == want and len(tokens) == 160
    assert busy[0] == grpc.StatusCode.FAILED_PRECONDITION and "adapter 'qv4' has 1 running request" in busy[1]
    assert info.pinned and info.rank == 16
    assert mid == merged_greedy(tiny_llama, tiny_adapters["mlp16"], PROMPTS[1:], N)[0]


def test_status_codes(loop, pair, tiny_llama, tiny_adapters, tmp_path) -> None:
    a, _ = pair
    params = sampling(max_tokens=2)

    async def go():
        out = {}
        out["bad path"] = await code_of(submit(a.endpoint, "bad", PROMPTS[0], params,
                                               adapter=worker_pb2.AdapterRef(name="bad", source=str(tmp_path / "x"))))
        out["no source"] = await code_of(submit(a.endpoint, "nosrc", PROMPTS[0], params,
                                                adapter=worker_pb2.AdapterRef(name="nowhere")))
        out["unload unknown"] = await code_of(call(a.endpoint, "UnloadAdapter",
                                                   worker_pb2.UnloadAdapterRequest(name="nowhere")))
        for name in ("all8", "qv4"):
            await call(a.endpoint, "LoadAdapter", worker_pb2.LoadAdapterRequest(
                adapter=ref(name, tiny_adapters[name]), pin=True))
        out["full"] = await code_of(call(a.endpoint, "LoadAdapter", worker_pb2.LoadAdapterRequest(
            adapter=ref("mlp16", tiny_adapters["mlp16"]))))
        for name in ("all8", "qv4"):
            await call(a.endpoint, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name=name))
        await clean(a)
        return out

    out = run(loop, go())
    assert out["bad path"][0] == grpc.StatusCode.INVALID_ARGUMENT and "adapter 'bad': source" in out["bad path"][1]
    assert out["no source"][0] == grpc.StatusCode.INVALID_ARGUMENT and "names no source" in out["no source"][1]
    assert out["unload unknown"][0] == grpc.StatusCode.NOT_FOUND
    assert out["full"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "lora.max_loaded" in out["full"][1]


def test_disaggregated_prefill_under_the_adapter(loop, pair, tiny_llama, tiny_adapters) -> None:
    a, b = pair
    params = sampling(max_tokens=N, ignore_eos=True)
    want = merged_greedy(tiny_llama, tiny_adapters["mlp16"], PROMPTS, N)
    rp = worker_pb2.RemotePrefill(worker_id=a.worker_id, endpoint=a.endpoint, incarnation=a.incarnation)

    async def go():
        for s in (a, b):  # neither holds it: both load it from the source (b on Submit, a on Prefill)
            listed = await call(s.endpoint, "ListAdapters", worker_pb2.ListAdaptersRequest())
            if any(x.name == "mlp16" for x in listed.adapters):
                await call(s.endpoint, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name="mlp16"))
        got = [await submit(b.endpoint, f"pd{i}", p, params, remote_prefill=rp,
                            adapter=ref("mlp16", tiny_adapters["mlp16"])) for i, p in enumerate(PROMPTS)]
        loads = [await call(s.endpoint, "GetLoad", worker_pb2.GetLoadRequest()) for s in (a, b)]
        await clean(a, b)
        return got, loads

    got, loads = run(loop, go())
    assert got == want
    assert all("mlp16" in r.adapters for r in loads)
    assert loads[1].kv_transfers_received >= len(PROMPTS)


def test_migration_carries_the_adapter(loop, pair, tiny_llama, tiny_adapters) -> None:
    a, b = pair
    long = sampling(max_tokens=200, ignore_eos=True)
    all8 = ref("all8", tiny_adapters["all8"])
    to = worker_pb2.MigrationTarget(worker_id=b.worker_id, endpoint=b.endpoint, incarnation=b.incarnation)

    async def go():
        listed = await call(b.endpoint, "ListAdapters", worker_pb2.ListAdaptersRequest())
        if any(x.name == "all8" for x in listed.adapters):
            await call(b.endpoint, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name="all8"))
        want = await submit(a.endpoint, "unmigrated", PROMPTS[1], long, adapter=all8)
        tokens: list[int] = []
        moved = None
        async with grpc.aio.insecure_channel(a.endpoint) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stream = stub.Submit(worker_pb2.SubmitRequest(request_id="mig", prompt_token_ids=PROMPTS[1],
                                                          sampling=long, adapter=all8))
            first = await stream.read()
            tokens += first.token_ids
            reply = await stub.Migrate(worker_pb2.MigrateRequest(request_id="mig", target=to))
            while (m := await stream.read()) is not grpc.aio.EOF:
                tokens += m.token_ids
                if m.HasField("migrated_to"):
                    moved = m.migrated_to
        assert moved is not None and reply.migration_id
        p = worker_pb2.SamplingParams()
        p.CopyFrom(long)
        p.max_tokens = long.max_tokens - len(tokens)
        tokens += await submit(moved.endpoint, "mig", PROMPTS[1] + tokens, p, resumed_output_tokens=len(tokens),
                               migration_id=moved.migration_id, adapter=all8)
        listed = await call(b.endpoint, "ListAdapters", worker_pb2.ListAdaptersRequest())
        await clean(a, b)
        return want, tokens, listed

    want, tokens, listed = run(loop, go(), timeout=300)
    assert tokens == want
    assert any(x.name == "all8" for x in listed.adapters)  # the target loaded it from the snapshot's source


def test_worker_without_lora_refuses_adapters(loop, tiny_llama) -> None:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=32, block_size=8))
    s = run(loop, start_worker_server(config, worker_id="nolora"))
    try:
        code, details = run(loop, code_of(submit(s.endpoint, "x", PROMPTS[0], sampling(max_tokens=2),
                                                 adapter=worker_pb2.AdapterRef(name="a", source="/nowhere"))))
        listed = run(loop, call(s.endpoint, "ListAdapters", worker_pb2.ListAdaptersRequest()))
    finally:
        run(loop, s.stop(grace=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "runs without LoRA" in details
    assert len(listed.adapters) == 0
