"""The router's SubmitMux against the worker's SubmitStreams (router/submit_mux.py,
workers/server/submit_stream.py) over real gRPC in one process, with a scripted Submit handler in
place of the engine: requests demultiplexed, a step's output of every request in one message,
statuses, cancel and deadline reaching the worker's handler, the stream failing and reopening; and a
router in front of workers without SubmitStream sending them Submit calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from testkit.ports import free_port

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.submit_mux import SubmitMux
from workers.server.submit_stream import SubmitStreams


class _Engine:
    """Stands in for the engine loop: a step hands every running request its next token at once
    (one loop turn, as workers/engine/loop.py delivers a step)."""

    def __init__(self) -> None:
        self.sinks: dict[str, asyncio.Queue[int]] = {}

    def step(self) -> None:
        for i, q in enumerate(self.sinks.values()):
            q.put_nowait(i)


class _Servicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.engine = _Engine()
        self.ended: dict[str, str] = {}  # request id -> how its handler ended
        self.batches: list[int] = []  # frames per SubmitStreamResponse written
        self.streams = SubmitStreams(self.Submit)

    async def Submit(self, request: worker_pb2.SubmitRequest, context):
        rid = request.request_id
        if rid.startswith("bad"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids: {rid} is bad")
        if rid.startswith("boom"):
            raise RuntimeError("kaput")
        q: asyncio.Queue[int] = asyncio.Queue()
        self.engine.sinks[rid] = q
        how = "cancelled"
        try:
            for n in range(request.sampling.max_tokens):
                token = await q.get()
                last = n == request.sampling.max_tokens - 1
                msg = worker_pb2.SubmitResponse(token_ids=[1000 * len(rid) + token])
                if last:
                    msg.finish_reason = worker_pb2.FINISH_REASON_LENGTH
                yield msg
            how = "finished"
        finally:
            self.ended[rid] = how
            del self.engine.sinks[rid]

    async def SubmitStream(self, request_iterator, context):
        async for batch in self.streams.serve(request_iterator):
            self.batches.append(len(batch.frames))
            yield batch


def _req(rid: str, max_tokens: int = 3) -> worker_pb2.SubmitRequest:
    return worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=[1, 2],
                                    sampling=worker_pb2.SamplingParams(max_tokens=max_tokens))


async def _serve(servicer: _Servicer, port: int | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{port or free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _collect(call) -> list[int]:
    return [t async for m in call for t in m.token_ids]


@contextlib.asynccontextmanager
async def _connected() -> AsyncIterator[tuple[_Servicer, SubmitMux]]:
    """A worker serving ``_Servicer`` and a router-side mux to it; the worker stops on exit."""
    servicer = _Servicer()
    server, address = await _serve(servicer)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield servicer, SubmitMux(worker_pb2_grpc.WorkerStub(channel))
    finally:
        await server.stop(0)


def test_requests_are_demultiplexed_and_a_step_is_one_message():
    async def go():
        async with _connected() as (servicer, mux):
            calls = {rid: mux.submit(_req(rid, 4)) for rid in ("a", "bb", "ccc")}
            readers = {rid: asyncio.ensure_future(_collect(c)) for rid, c in calls.items()}
            await _until(lambda: len(servicer.engine.sinks) == 3)
            for _ in range(4):
                servicer.engine.step()
                await asyncio.sleep(0.05)
            out = {rid: await r for rid, r in readers.items()}
            assert all(c.done() for c in calls.values())
            assert mux.open_requests == 0
        # each request got its own tokens, in order (the scripted token is the request's position
        # in the step: insertion order a, bb, ccc)
        assert out == {"a": [1000, 1000, 1000, 1000], "bb": [2001] * 4, "ccc": [3002] * 4}
        # one message per step carrying all three requests' frames (+ the three ends after the last)
        assert servicer.batches == [3, 3, 3, 6], servicer.batches
        assert servicer.ended == {"a": "finished", "bb": "finished", "ccc": "finished"}

    asyncio.run(go())


def test_statuses_end_only_their_request():
    async def go():
        async with _connected() as (servicer, mux):
            good = mux.submit(_req("good", 2))
            reader = asyncio.ensure_future(_collect(good))
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await _collect(mux.submit(_req("bad1")))
            with pytest.raises(grpc.aio.AioRpcError) as boom:
                await _collect(mux.submit(_req("boom")))
            await _until(lambda: "good" in servicer.engine.sinks)
            servicer.engine.step()
            servicer.engine.step()
            assert await reader == [4000, 4000]
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.value.details() == "prompt_token_ids: bad1 is bad"
        assert boom.value.code() == grpc.StatusCode.UNKNOWN and "kaput" in boom.value.details()

    asyncio.run(go())


def test_cancel_and_deadline_reach_the_workers_handler():
    async def go():
        async with _connected() as (servicer, mux):
            cancelled = mux.submit(_req("c", 10))
            timed = mux.submit(_req("t", 10), timeout=0.3)
            await _until(lambda: len(servicer.engine.sinks) == 2)
            servicer.engine.step()
            assert [t for t in (await cancelled.__anext__()).token_ids] == [1000]
            assert cancelled.cancel() and cancelled.done() and not cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled.__anext__()
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await _collect(timed)
            await _until(lambda: servicer.ended == {"c": "cancelled", "t": "cancelled"})
            assert mux.open_requests == 0
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(go())


def test_a_worker_that_stops_fails_its_requests_and_the_next_request_reopens():
    async def go():
        port = free_port()
        servicer = _Servicer()
        server, address = await _serve(servicer, port)
        async with grpc.aio.insecure_channel(address) as channel:
            mux = SubmitMux(worker_pb2_grpc.WorkerStub(channel))
            running = mux.submit(_req("r", 10))
            await _until(lambda: "r" in servicer.engine.sinks)
            await server.stop(0)  # the worker went away mid-request
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await _collect(running)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.ended == {"r": "cancelled"}  # the handler was cancelled: KV freed
            servicer2 = _Servicer()
            server2, _ = await _serve(servicer2, port)
            try:
                again = mux.submit(_req("r", 1))
                await _until(lambda: "r" in servicer2.engine.sinks)
                servicer2.engine.step()
                assert await _collect(again) == [1000]
            finally:
                await server2.stop(0)

    asyncio.run(go())


def test_close_ends_idle_streams_after_their_requests():
    async def go():
        async with _connected() as (servicer, mux):
            call = mux.submit(_req("x", 1))
            await _until(lambda: "x" in servicer.engine.sinks)
            closing = asyncio.ensure_future(servicer.streams.close(timeout_s=5.0))
            await asyncio.sleep(0.1)
            assert not closing.done()  # a request still runs on the stream
            servicer.engine.step()
            assert await _collect(call) == [1000]
            await asyncio.wait_for(closing, 2.0)  # then the stream ends at once
            assert mux.open_requests == 0

    asyncio.run(go())


def test_a_router_streams_from_an_older_worker_through_submit_calls(smollm2_path, tok):
    """Workers whose load reports do not say they serve SubmitStream (a release before it, mid rolling
    upgrade) get a Submit call per request, deadlines included: no stream is opened to them."""
    from protos.duet.v1 import duet_pb2, duet_pb2_grpc
    from router.config import RouterConfig
    from router.server import serve_router
    from testkit.router_fakes import SCRIPT, fake_pool, members

    with fake_pool(tok) as servers:
        for s in servers:  # their load reports, as an older worker's, do not say they serve SubmitStream
            s.worker.submit_stream = False
        router = serve_router(RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0,
                                           load_poll_interval_s=0.05), members(servers), tokenizer=tok)
        try:
            with grpc.insecure_channel(router.address) as channel:
                stub = duet_pb2_grpc.DuetStub(channel)
                for _ in range(4):  # both workers, each at least once
                    out = list(stub.Generate(duet_pb2.GenerateRequest(
                        prompt="x", sampling=duet_pb2.SamplingParams(max_tokens=6, temperature=0)), timeout=20))
                    assert [t for r in out for t in r.token_ids] == tok.encode(SCRIPT, add_special_tokens=False)[:6]
            deadlines = [d for s in servers for d in s.worker.deadlines.values()]
            assert len(deadlines) == 4 and all(d is not None and d < 21 for d in deadlines)
            assert router.server.directory.open_stream_requests() == 0
            assert all(s.worker.streams.open_streams == 0 for s in servers)  # none opened (a router keeps the ones it opens)
            assert all(s.worker.active == 0 for s in servers)
        finally:
            router.stop(0)
