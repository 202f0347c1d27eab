"""Live migration through the worker gRPC service, in process (no Ray): a request streaming from
worker A is moved to worker B (Migrate -> TakeOver -> KV over a real gloo pair group), its Submit
stream on A ends with ``migrated_to``, and a follower (what the router does) attaches to B with
``migration_id`` and reads the rest. Tokens equal an unmigrated run (greedy, seeded, penalised);
faults leave the request running on A (or free everything on B); nothing leaks; a drain moves
every running request away.

Faults covered: target unreachable, target with a different model, target without free blocks,
a block corrupted in transit, the target failing after it reserved, the source going away after
the target reserved, a migrated request nobody attaches to."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.handoff.migration_service import MigrationFailed, snapshot_to_proto
from workers.server.service import start_worker_server

from tests.workers.engine.test_migration_engine import LONG
from tests.workers.server.test_worker_service import PROMPTS, run, sampling


@pytest.fixture(scope="module")
def pair(loop, smollm2_path):
    def config(kv_bytes: int) -> EngineConfig:
        return EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=kv_bytes),
                            scheduler=SchedulerConfig(max_num_batched_tokens=64))
    a = run(loop, start_worker_server(config(24 << 20), worker_id="mig-a", kv_transfer_timeout_s=10,
                                      migration_attach_timeout_s=2.0))
    b = run(loop, start_worker_server(config(24 << 20), worker_id="mig-b", kv_transfer_timeout_s=10,
                                      migration_attach_timeout_s=2.0))
    yield a, b
    run(loop, a.stop(grace=1))
    run(loop, b.stop(grace=1))


def target(server) -> worker_pb2.MigrationTarget:
    return worker_pb2.MigrationTarget(worker_id=server.worker_id, endpoint=server.endpoint,
                                      incarnation=server.incarnation)


async def load(endpoint: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())


async def migrate(server, rid: str, to: worker_pb2.MigrationTarget) -> worker_pb2.MigrateResponse:
    async with grpc.aio.insecure_channel(server.endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).Migrate(worker_pb2.MigrateRequest(request_id=rid, target=to))


async def follow(endpoint: str, rid: str, ids: list[int], params: worker_pb2.SamplingParams,
                 on_tokens=None) -> tuple[list[int], int]:
    """Stream a request like the router does, following ``migrated_to`` to the next worker
    (attach: prompt + streamed tokens, migration_id). -> (tokens, hops)."""
    tokens: list[int] = []
    migration_id, hops = "", 0
    while True:
        p = worker_pb2.SamplingParams()
        p.CopyFrom(params)
        p.max_tokens = params.max_tokens - len(tokens)
        p.min_tokens = max(0, params.min_tokens - len(tokens))
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids + tokens, sampling=p,
                                       resumed_output_tokens=len(tokens), migration_id=migration_id)
        moved = None
        async with grpc.aio.insecure_channel(endpoint) as channel:
            async for m in worker_pb2_grpc.WorkerStub(channel).Submit(req):
                tokens += m.token_ids
                if on_tokens is not None and m.token_ids:
                    on_tokens(len(tokens))
                if m.HasField("migrated_to"):
                    moved = m.migrated_to
                elif m.HasField("finish_reason"):
                    return tokens, hops
        assert moved is not None, "a stream ends with a finish reason or migrated_to"
        assert moved.num_output_tokens + len(ids) <= len(ids) + len(tokens)
        endpoint, migration_id, hops = moved.endpoint, moved.migration_id, hops + 1


async def follow_and_migrate(a, rid, ids, params, after: int, to, result: dict):
    """Stream from a; once ``after`` tokens arrived, ask a to migrate the request to ``to``
    (the outcome, a MigrateResponse or the error, goes into result[rid])."""
    tasks = []

    def on_tokens(n):
        if n >= after and not tasks:
            async def go():
                try:
                    result[rid] = await migrate(a, rid, to)
                except grpc.aio.AioRpcError as e:
                    result[rid] = e
            tasks.append(asyncio.ensure_future(go()))
    out = await follow(a.endpoint, rid, ids, params, on_tokens)
    if tasks:
        await tasks[0]
    return out


async def assert_clean(*servers):
    for s in servers:
        r = await load(s.endpoint)
        assert r.kv_blocks_used == 0 and r.num_reserved == 0 and r.num_running == 0, (s.worker_id, r)


PARAMS = [sampling(max_tokens=14, ignore_eos=True),
          sampling(max_tokens=14, temperature=0.8, top_k=40, seed=5, ignore_eos=True),
          sampling(max_tokens=12, temperature=0.9, seed=8, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.5, min_tokens=6, stop=[" the"])]


def test_migrated_streams_equal_unmigrated(loop, pair, tokenizer):
    a, b = pair
    prompts = [tokenizer.encode(p) for p in (PROMPTS[0], LONG)]
    cases = [(f"{i}-{j}", ids, p) for i, ids in enumerate(prompts) for j, p in enumerate(PARAMS)]

    async def go():
        before_a, before_b = await load(a.endpoint), await load(b.endpoint)
        want = await asyncio.gather(*(follow(a.endpoint, f"ref{k}", ids, p) for k, ids, p in cases))
        result: dict = {}
        got = await asyncio.gather(*(follow_and_migrate(a, f"m{k}", ids, p, 2 + n % 5, target(b), result)
                                     for n, (k, ids, p) in enumerate(cases)))
        await assert_clean(a, b)
        return want, got, result, before_a, before_b, await load(a.endpoint), await load(b.endpoint)

    want, got, result, before_a, before_b, la, lb = run(loop, go(), timeout=600)
    assert [t for t, _ in got] == [t for t, _ in want]
    moved = [rid for rid, r in result.items() if isinstance(r, worker_pb2.MigrateResponse)]
    # (a request may stop at its stop string before its migration starts: it then finishes on a)
    assert len(moved) >= len(cases) - 1, result
    assert all(hops == 1 for (_, hops), (k, _, _) in zip(got, cases) if f"m{k}" in moved)
    assert la.migrations_out - before_a.migrations_out == len(moved) == lb.migrations_in - before_b.migrations_in
    assert lb.migration_kv_bytes > before_b.migration_kv_bytes and la.migration_seconds > 0


def _one_request_fault(loop, a, b, tokenizer, to, expect: grpc.StatusCode):
    """A request on a whose migration to ``to`` fails with ``expect``: it completes on a, unmoved, identical."""
    ids, p = tokenizer.encode(PROMPTS[1]), PARAMS[1]

    async def go():
        want, _ = await follow(a.endpoint, "fref", ids, p)
        result: dict = {}
        got, hops = await follow_and_migrate(a, "fm", ids, p, 3, to, result)
        await assert_clean(a, b)
        return want, got, hops, result["fm"]

    want, got, hops, error = run(loop, go(), timeout=300)
    assert got == want and hops == 0
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == expect, error
    return error


def test_target_unreachable_keeps_the_request(loop, pair, tokenizer):
    a, b = pair
    dead = worker_pb2.MigrationTarget(worker_id="gone", endpoint="127.0.0.1:1")
    _one_request_fault(loop, a, b, tokenizer, dead, grpc.StatusCode.UNAVAILABLE)


def test_target_with_a_different_model_refuses(loop, pair, tokenizer, monkeypatch):
    a, b = pair
    monkeypatch.setattr(a.servicer.migrator, "fingerprint", "another-model")
    e = _one_request_fault(loop, a, b, tokenizer, target(b), grpc.StatusCode.FAILED_PRECONDITION)
    assert "model_fingerprint" in e.details()


def test_target_without_free_blocks_refuses(loop, pair, tokenizer):
    a, b = pair
    hog_ids = (tokenizer.encode(LONG) * 8)[: b.limits.max_model_len - 48]

    async def fill_b():  # a long request on b, paused (it keeps its blocks): b has almost none free
        async with grpc.aio.insecure_channel(b.endpoint) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Submit(worker_pb2.SubmitRequest(
                request_id="hog", prompt_token_ids=hog_ids, sampling=sampling(max_tokens=40, ignore_eos=True)))
            await call.read()
            await b.servicer._engine.call(lambda e: e.pause_request("hog"))
            free = (lambda r: r.kv_blocks_total - r.kv_blocks_used)(await load(b.endpoint))
            ids, p = tokenizer.encode("Notes on zebra migration, written for nobody in particular. " * 8), PARAMS[0]
            assert free < len(ids) // b.limits.kv_layout.block_size, free  # (b has none of these cached)
            result: dict = {}
            got, hops = await follow_and_migrate(a, "full", ids, p, 3, target(b), result)
            call.cancel()  # the hog's stream goes away: b aborts it, paused or not
            want, _ = await follow(a.endpoint, "fullref", ids, p)
            for _ in range(100):
                if (await load(b.endpoint)).kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.02)
            await assert_clean(a, b)
            return got, want, hops, result["full"]

    got, want, hops, error = run(loop, fill_b(), timeout=300)
    assert got == want and hops == 0
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error


def test_corrupted_block_is_rejected_and_the_request_continues(loop, pair, tokenizer, monkeypatch):
    """A value flipped in transit (what arrives differs from what the sender checksummed; whatever
    the transport, shared memory or gloo): the target rejects the transfer and frees its
    reservation, the source resumes the request; the next migration (a new pair generation) goes
    through."""
    from workers.kv import transfer as kv_transfer

    a, b = pair
    original = kv_transfer.KVReceiver._deliver
    corrupted = []

    def deliver_corrupted(self, key, tid, first, checks, kv, nbytes, dt, hashes=None):
        if not corrupted:
            corrupted.append(tid)
            kv = kv.clone()
            kv.view(-1)[7] += 1.0
            if hashes is not None:  # the shm ring hashed the bytes as they arrived: these bytes
                hashes = kv_transfer.block_checksums(kv).tolist()
        return original(self, key, tid, first, checks, kv, nbytes, dt, hashes)

    monkeypatch.setattr(kv_transfer.KVReceiver, "_deliver", deliver_corrupted)
    _one_request_fault(loop, a, b, tokenizer, target(b), grpc.StatusCode.UNAVAILABLE)
    assert corrupted

    async def again():
        ids, p = tokenizer.encode(PROMPTS[2]), PARAMS[0]
        want, _ = await follow(a.endpoint, "cref", ids, p)
        result: dict = {}
        got, hops = await follow_and_migrate(a, "cm", ids, p, 3, target(b), result)
        await assert_clean(a, b)
        return want, got, hops
    want, got, hops = run(loop, again(), timeout=300)
    assert got == want and hops == 1


def test_target_failing_after_its_reservation(loop, pair, tokenizer, monkeypatch):
    a, b = pair
    original = b.servicer.migrator.take_over

    async def dies_after_reserving(request):
        async for msg in original(request):
            yield msg
            raise MigrationFailed(grpc.StatusCode.UNAVAILABLE, "the target went away")

    monkeypatch.setattr(b.servicer.migrator, "take_over", dies_after_reserving)
    _one_request_fault(loop, a, b, tokenizer, target(b), grpc.StatusCode.UNAVAILABLE)


def test_source_gone_after_the_target_reserved(loop, pair, tokenizer):
    """The source pauses a request, the target reserves for it, then the source's call goes away
    (it died): the target frees the reservation; the paused request resumes on the source."""
    a, b = pair
    ids, p = tokenizer.encode(LONG), PARAMS[0]

    async def go():
        want, _ = await follow(a.endpoint, "sref", ids, p)
        box: dict = {}

        def on_tokens(n):
            if n == 3 and "task" not in box:
                box["task"] = asyncio.ensure_future(fake_dying_source())

        async def fake_dying_source():
            snap = await a.servicer._engine.call(lambda e: e.pause_request("s1"))
            m = a.servicer.migrator
            async with grpc.aio.insecure_channel(b.endpoint) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).TakeOver(worker_pb2.TakeOverRequest(
                    request_id="s1", state=snapshot_to_proto(snap), source_worker_id=a.worker_id,
                    source_incarnation=a.incarnation, model_fingerprint=m.fingerprint,
                    kv_layout=a.limits.kv_layout.as_words(), source_endpoint=a.endpoint))
                first = await call.read()
                box["reserved"] = (await load(b.endpoint)).num_reserved
                call.cancel()
            for _ in range(100):
                if (await load(b.endpoint)).kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.02)
            box["first"] = first
            assert await a.servicer._engine.call(lambda e: e.resume_request("s1"))

        got, hops = await follow(a.endpoint, "s1", ids, p, on_tokens)
        await box["task"]
        await assert_clean(a, b)
        return want, got, hops, box

    want, got, hops, box = run(loop, go(), timeout=300)
    assert got == want and hops == 0
    assert box["reserved"] == 1 and box["first"].num_blocks >= 1


def test_unattached_migration_is_aborted_on_the_target(loop, pair, tokenizer):
    a, b = pair
    ids, p = tokenizer.encode(PROMPTS[0]), sampling(max_tokens=400, ignore_eos=True)

    async def go():
        async with grpc.aio.insecure_channel(a.endpoint) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Submit(worker_pb2.SubmitRequest(
                request_id="orphan", prompt_token_ids=ids, sampling=p))
            await call.read()
            reply = await migrate(a, "orphan", target(b))
            tail = []
            while (m := await call.read()) is not grpc.aio.EOF:
                tail.append(m)
        assert tail[-1].HasField("migrated_to") and tail[-1].migrated_to.migration_id == reply.migration_id
        assert (await load(b.endpoint)).num_running == 1  # decoding on b, waiting for an attach
        await asyncio.sleep(2.5)  # the fixture's attach timeout is 2 s
        await assert_clean(a, b)

    run(loop, go(), timeout=120)


def test_bad_migrate_requests_are_named(loop, pair):
    a, b = pair

    async def go():
        codes = []
        for rid, to in (("nobody", target(b)), ("", target(b))):
            try:
                await migrate(a, rid, to)
            except grpc.aio.AioRpcError as e:
                codes.append((e.code(), e.details()))
        return codes

    codes = run(loop, go())
    assert [c for c, _ in codes] == [grpc.StatusCode.NOT_FOUND] * 2
    assert all("request_id" in d for _, d in codes)


def test_drain_moves_every_running_request(loop, pair, tokenizer):
    """Last in the module: a drained worker takes no new requests."""
    a, b = pair
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    params = sampling(max_tokens=24, ignore_eos=True)

    async def go():
        want = await asyncio.gather(*(follow(b.endpoint, f"dref{i}", ids, params) for i, ids in enumerate(prompts)))
        started = asyncio.Event()
        counts = [0] * len(prompts)

        def seen(i):
            def on(n):
                counts[i] = n
                if min(counts) >= 2:
                    started.set()
            return on
        streams = [asyncio.ensure_future(follow(a.endpoint, f"d{i}", ids, params, seen(i)))
                   for i, ids in enumerate(prompts)]
        await started.wait()
        async with grpc.aio.insecure_channel(a.endpoint) as channel:
            reply = await worker_pb2_grpc.WorkerStub(channel).Drain(
                worker_pb2.DrainRequest(targets=[target(b)], timeout_s=60))
        got = await asyncio.gather(*streams)
        await assert_clean(a, b)
        return want, got, reply, await load(a.endpoint)

    want, got, reply, la = run(loop, go(), timeout=600)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert reply.migrated == 4 and reply.remaining == 0 and all(h == 1 for _, h in got)
    assert la.draining and la.num_running == 0
    assert torch.tensor([reply.seconds]).item() < 60
