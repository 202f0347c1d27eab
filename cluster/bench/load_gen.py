"""Load generation for `duet bench`: the workload, Poisson arrivals, and the two request senders.

Workload (deterministic for a given seed):
    prompt      the user turn of a chat: request i takes a prompt drawn uniformly (with replacement)
                from cluster/bench/data/serving_prompts.txt (32 prompts, 8-40 words), wrapped in the
                model's chat template (what the router does for a `messages` request)
    max_tokens  drawn uniformly from [min_output, max_output] (inclusive); the request runs with
                ignore_eos, so it produces exactly that many tokens
    arrivals    a Poisson process of rate R requests/s: exponential gaps with mean 1/R from the same
                seeded generator; R = inf sends everything at t = 0

Senders, one per path, timing the same way (first/last byte of each streamed message):
    RouterSender   duet.v1.Duet/Generate on the public router (tokenization, template, routing and
                   detokenization all happen in the router, inside the measured time)
    WorkerSender   duet.worker.v1.Worker/Submit straight to one worker's internal endpoint with the
                   token ids the router would have sent (tokenized here, before the clock starts)
The difference between the two on the same load is the router's overhead.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from cluster.bench.metrics import RequestRecord
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.client import auth_metadata
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "serving_prompts.txt"


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # the user message
    prompt_ids: tuple[int, ...]  # the chat-templated token ids the router produces for it
    max_tokens: int


def load_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def build_workload(tokenizer: Any, num_requests: int, *, seed: int, min_output: int, max_output: int,
                   prompts: list[str] | None = None) -> list[BenchRequest]:
    """``num_requests`` requests as described in the module docstring."""
    if not 1 <= min_output <= max_output:
        raise ValueError(f"output lengths: need 1 <= min_output ({min_output}) <= max_output ({max_output})")
    prompts = prompts or load_prompts()
    rng = random.Random(seed)
    cache: dict[str, tuple[int, ...]] = {}
    out = []
    for _ in range(num_requests):
        text = rng.choice(prompts)
        if text not in cache:
            templated = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
            cache[text] = tuple(tokenizer.encode(templated, add_special_tokens=False))
        out.append(BenchRequest(text, cache[text], rng.randint(min_output, max_output)))
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (seconds from the start) of ``n`` requests arriving at ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 (inf = all at once), got {rate}")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


class Sender(Protocol):
    name: str

    async def send(self, request: BenchRequest, record: RequestRecord) -> None: ...


class RouterSender:
    """Streams ``Generate`` from the public router; records each message that carries tokens."""

    name = "router"

    def __init__(self, channel: grpc.aio.Channel, timeout: float, token: str | None = None) -> None:
        self.stub = duet_pb2_grpc.DuetStub(channel)
        self.timeout = timeout
        self.metadata = auth_metadata(token)
        self._ids = itertools.count()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        msg = duet_pb2.GenerateRequest(
            messages=duet_pb2.ChatMessages(messages=[duet_pb2.ChatMessage(role="user", content=request.prompt)]),
            sampling=duet_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
            request_id=f"bench-{next(self._ids)}")
        await _stream(self.stub.Generate(msg, timeout=self.timeout, metadata=self.metadata), record)


class WorkerSender:
    """Streams ``Submit`` from one worker's internal endpoint with pre-tokenized prompts."""

    name = "direct"

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self.stub = worker_pb2_grpc.WorkerStub(channel)
        self.timeout = timeout
        self._ids = itertools.count()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        msg = worker_pb2.SubmitRequest(
            request_id=f"bench-direct-{time.monotonic_ns()}-{next(self._ids)}",
            prompt_token_ids=list(request.prompt_ids),
            sampling=worker_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, top_p=1.0,
                                               ignore_eos=True))
        await _stream(self.stub.Submit(msg, timeout=self.timeout), record)


async def _stream(call: Any, record: RequestRecord) -> None:
    try:
        async for response in call:
            if response.token_ids:
                record.chunk_times.append(time.perf_counter())
                record.chunk_tokens.append(len(response.token_ids))
            if response.HasField("finish_reason"):
                record.prompt_tokens = response.usage.prompt_tokens
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"


async def run_open_loop(sender: Sender, requests: list[BenchRequest], arrivals: list[float]) -> list[RequestRecord]:
    """Send request i at ``arrivals[i]`` seconds after the start, whatever is still running."""
    start = time.perf_counter()
    records = [RequestRecord(send=0.0) for _ in requests]

    async def one(i: int) -> None:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        records[i].send = time.perf_counter()
        await sender.send(requests[i], records[i])

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    return records


async def run_alternating(senders: list[Sender], requests: list[BenchRequest]) -> dict[str, list[RequestRecord]]:
    """Closed loop, one request at a time: each request goes through every sender in turn
    (the order rotating per request), so slow drift on the machine hits every path alike."""
    out: dict[str, list[RequestRecord]] = {s.name: [] for s in senders}
    for i, request in enumerate(requests):
        for sender in senders[i % len(senders):] + senders[:i % len(senders)]:
            record = RequestRecord(send=time.perf_counter())
            await sender.send(request, record)
            out[sender.name].append(record)
    return out
