"""Test doubles for the router tests: an in-process fake worker (duet.worker.v1) and helpers to
run it and the router on background event loops.

FakeWorker replays a fixed token sequence: the real SmolLM2 tokenization of SCRIPT (which has
multi-byte characters that span tokens) followed by EOS, ``tokens_per_message`` ids per message,
``delay_s`` apart, capped by max_tokens. Like a deterministic (greedy) model it continues the
script where the prompt leaves off: a prompt ending with the script's first k ids gets ids k, k+1, ...
(so a request the router resumes after a worker failure continues exactly). It ignores stop strings (so the router's own stop-string
handling and the cancel it sends are exercised) and records what it saw: submitted requests,
deadlines, cancellations. Knobs (set from the test thread, read on the worker loop):

    delay_s             sleep between messages
    tokens_per_message  ids per SubmitResponse
    die_after           after this many ids: "abort" ends the stream with UNAVAILABLE, "stop" stops
                        the whole server (the worker process died); None = never
    fail                (StatusCode, message): reject every Submit with it
With sampling.top_logprobs set it sends one TokenLogprob per id (``fake_logprob``).
    hang                stop answering GetLoad and stop streaming (a node that vanished silently)
    lora                speak the LoRA adapter contract of duet.worker.v1 (LoadAdapter, UnloadAdapter,
                        ListAdapters, SubmitRequest.adapter, LoadReport.adapters); off (the default),
                        the adapter RPCs answer UNIMPLEMENTED, as a worker without LoRA support does
    bad_sources         adapter sources refused with INVALID_ARGUMENT (a bad PEFT directory)
    busy_adapters       UnloadAdapter answers FAILED_PRECONDITION for these (requests still use them)
    extra_load          added to the reported outstanding_tokens (an overloaded worker)
    submit_stream       say so in the load report (the default: it serves SubmitStream through the
                        worker's own SubmitStreams, so the router's requests take its SubmitMux);
                        False: the reports do not, as an older worker's, and the router sends one
                        Submit call per request
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from testkit.ports import free_port  # noqa: F401 - re-exported: tests import it from here
from workers.server.submit_stream import SubmitStreams

SCRIPT = "Héllo wörld! 日本語のテキスト 🙂 The quick brown fox jumps over the lazy dog. Ünïcödé ✓ done"
WORKER_HEALTH = "duet.worker.v1.Worker"


def _script_offset(prompt: list[int], script: list[int]) -> int:
    """The largest k such that the prompt ends with script[:k] (0 if none)."""
    for k in range(min(len(prompt), len(script)), 0, -1):
        if prompt[-k:] == script[:k]:
            return k
    return 0


def fake_logprob(token_id: int, position: int, k: int) -> worker_pb2.TokenLogprob:
    """What FakeWorker reports for script position ``position`` (deterministic, so tests can check it)."""
    lp = -0.01 * (position + 1)
    return worker_pb2.TokenLogprob(token_id=token_id, logprob=lp, top_logprobs=[
        worker_pb2.TopLogprob(token_id=token_id + j, logprob=lp - j) for j in range(k)])


class LoopThread:
    """An asyncio loop on a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, script_ids: list[int], eos_id: int) -> None:
        self.worker_id = worker_id
        self.script_ids = list(script_ids) + [eos_id]
        self.eos_id = eos_id
        self.server: FakeWorkerServer | None = None
        self.active = 0  # Submit calls running now (not reset: a cancelled call decrements it later)
        self.streams = SubmitStreams(self.Submit)  # SubmitStream, as a real worker serves it
        self.submit_stream = True
        self.reset()

    def reset(self) -> None:
        self.delay_s = 0.0
        self.tokens_per_message = 1
        self.die_after: int | None = None
        self.die_mode = "abort"
        self.fail: tuple[grpc.StatusCode, str] | None = None
        self.hang = False
        self.submitted: list[worker_pb2.SubmitRequest] = []
        self.deadlines: dict[str, float | None] = {}
        self.cancelled: list[str] = []
        self.cancelled_event = threading.Event()
        self.lora = False
        self.adapters: dict[str, worker_pb2.AdapterInfo] = {}
        self.bad_sources: set[str] = set()
        self.busy_adapters: set[str] = set()
        self.extra_load = 0
        self.adapter_calls: list[tuple[str, str]] = []  # (rpc, adapter name) in arrival order

    def _load_adapter(self, ref: worker_pb2.AdapterRef, pin: bool) -> worker_pb2.AdapterInfo:
        """The contract's LoadAdapter: (StatusCode, message) raised as a tuple for a refusal."""
        if ref.source in self.bad_sources:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"adapter {ref.name}: {ref.source}: no "
                           "adapter_config.json (not a PEFT adapter directory)")
        info = self.adapters.get(ref.name) or worker_pb2.AdapterInfo(name=ref.name, source=ref.source, rank=8,
                                                                     target_modules=["q_proj", "v_proj"])
        info.pinned = info.pinned or pin
        self.adapters[ref.name] = info
        return info

    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        self.adapter_calls.append(("load", request.adapter.name))
        if not self.lora:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        try:
            return self._load_adapter(request.adapter, request.pin)
        except _Refusal as e:
            await context.abort(e.code, e.message)

    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        self.adapter_calls.append(("unload", request.name))
        if not self.lora:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        if request.name not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name} is not loaded here")
        if request.name in self.busy_adapters:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {request.name}: requests still run")
        del self.adapters[request.name]
        return worker_pb2.UnloadAdapterResponse()

    async def ListAdapters(self, request: worker_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        if not self.lora:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return worker_pb2.AdapterList(adapters=list(self.adapters.values()), max_loaded=4)

    async def Submit(self, request: worker_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        self.submitted.append(request)
        self.deadlines[rid] = context.time_remaining()
        if self.fail is not None:
            await context.abort(*self.fail)
        if request.adapter.name and self.lora:  # loaded first if this worker lacks it (the contract)
            try:
                self._load_adapter(request.adapter, False)
            except _Refusal as e:
                await context.abort(e.code, e.message)
        start = _script_offset(list(request.prompt_token_ids), self.script_ids)
        n = min(start + request.sampling.max_tokens, len(self.script_ids))
        self.active += 1
        try:
            i = start
            while i < n:
                if self.die_after is not None and i - start >= self.die_after:
                    await self._die(context)
                while self.hang:
                    await asyncio.sleep(0.01)
                chunk = self.script_ids[i : min(i + self.tokens_per_message, n)]
                i += len(chunk)
                response = worker_pb2.SubmitResponse(token_ids=chunk)
                if request.sampling.HasField("top_logprobs"):
                    response.logprobs.extend(fake_logprob(t, i - len(chunk) + j, request.sampling.top_logprobs)
                                             for j, t in enumerate(chunk))
                if i >= n:
                    eos = chunk[-1] == self.eos_id
                    response.finish_reason = worker_pb2.FINISH_REASON_STOP if eos else worker_pb2.FINISH_REASON_LENGTH
                    response.usage.prompt_tokens = len(request.prompt_token_ids)
                    response.usage.completion_tokens = n - start
                yield response
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            self.cancelled_event.set()
            raise
        finally:
            self.active -= 1

    async def SubmitStream(self, request_iterator, context: grpc.aio.ServicerContext):
        async for batch in self.streams.serve(request_iterator):
            yield batch

    async def _die(self, context: grpc.aio.ServicerContext) -> None:
        if self.die_mode == "abort":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker dying")
        assert self.server is not None
        asyncio.ensure_future(self.server.stop())
        await asyncio.sleep(3600)  # cancelled by the server's stop

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        return worker_pb2.AbortResponse(found=False)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        while self.hang:
            await asyncio.sleep(0.01)
        assert self.server is not None
        return worker_pb2.LoadReport(worker_id=self.worker_id, incarnation=self.server.incarnation,
                                     submit_stream=self.submit_stream,
                                     num_running=self.active, outstanding_tokens=10 * self.active + self.extra_load,
                                     kv_block_size=16, kv_blocks_total=1024, adapters=sorted(self.adapters),
                                     max_loaded_adapters=4 if self.lora else 0)


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class FakeWorkerServer:
    """A FakeWorker behind a grpc.aio server (+ health) on ``loop_thread``; restartable on its port."""

    def __init__(self, loop_thread: LoopThread, worker: FakeWorker) -> None:
        self.lt = loop_thread
        self.worker = worker
        worker.server = self
        self.port = 0
        self.incarnation = ""
        self._server: grpc.aio.Server | None = None
        self.health: Any = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        async def start() -> None:
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(self.worker, server)
            self.health = health.aio.HealthServicer()
            await self.health.set(WORKER_HEALTH, health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
            self.incarnation = uuid.uuid4().hex[:8]
            await server.start()
            self._server = server
        self.lt.run(start())

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)

    def stop_sync(self) -> None:
        self.lt.run(self.stop())

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.lt.run(self.health.set(WORKER_HEALTH, status))


def start_fake_pool(loop_thread: LoopThread, tokenizer: Any, n: int = 2) -> list[FakeWorkerServer]:
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    servers = [FakeWorkerServer(loop_thread, FakeWorker(f"w{i}", ids, tokenizer.eos_token_id)) for i in range(n)]
    for s in servers:
        s.start()
    return servers


@functools.cache
def load_tokenizer(path: str) -> Any:
    """The SmolLM2 tokenizer, loaded once per test session (shared by the router test modules)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def router_config(tokenizer_path: Path | str, **overrides: Any) -> RouterConfig:
    """A router config for tests: any free port, no HTTP API (``http_port=free_port()`` adds it),
    round-robin, a fast load poll."""
    fields: dict[str, Any] = dict(tokenizer_path=str(tokenizer_path), port=0, http_port=0, max_model_len=512,
                                  policy="round_robin", load_poll_interval_s=0.05)
    return RouterConfig(**{**fields, **overrides})


def members(servers: list[FakeWorkerServer]) -> list[tuple[str, str]]:
    return [(s.worker.worker_id, s.endpoint) for s in servers]


_client_loop: LoopThread | None = None


def run_async(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    """Run a test's client coroutine on one session-wide loop thread. (asyncio.run per test would
    close a loop per test; grpc.aio's shared poller can still post a late event to a closed loop
    and log "Event loop is closed". One long-lived loop avoids that.)"""
    global _client_loop
    if _client_loop is None:
        _client_loop = LoopThread()
    return _client_loop.run(coro, timeout)


@contextlib.contextmanager
def fake_pool(tokenizer: Any, n: int = 2) -> Iterator[list[FakeWorkerServer]]:
    """``n`` fake workers serving on one background loop, stopped on exit (the ``pool`` fixtures)."""
    lt = LoopThread()
    servers = start_fake_pool(lt, tokenizer, n)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop_sync()
        lt.close()


