"""`duet bench` over the OpenAI-compatible HTTP API (cluster/bench/serving.py runs these): a sender for the load generator, and two phases
that compare the APIs and the n fan-out side by side in one run.

    OpenAISender   POST /v1/chat/completions with stream=true on the router's HTTP port, the same
                   requests RouterSender sends over gRPC (the user message, max_tokens, greedy,
                   ignore_eos); timed the same way (arrival of each SSE event for a token delta,
                   which the router sends even while the text is held back);
                   token counts come from the final usage chunk (stream_options.include_usage).
    api phase      closed loop, one request at a time, each request over gRPC and over HTTP back to
                   back (order alternating): HTTP's added TTFT and time per token, as medians of the
                   per-request differences. Targets: < 1 ms TTFT, < 0.1 ms per token.
    n phase        closed loop: one sample (n=1) vs four (n=4) of a ~500-token prompt, each trial on
                   fresh prompts (no prefix-cache hit from an earlier trial); E2E of the whole request.
                   Target: n=4 < 2x n=1 (the prompt is computed once, the choices decode batched).
"""

from __future__ import annotations

import itertools
import json
import math
import ssl
import statistics
import time
from typing import Any

import grpc
import httpx

from cluster.bench.load_gen import BenchRequest, RouterSender, Sender, load_prompts, run_alternating
from cluster.bench.metrics import RequestRecord
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.client import ClientTLS, auth_metadata, open_channel

TARGET_HTTP_TTFT_OVERHEAD_MS = 1.0
TARGET_HTTP_PER_TOKEN_OVERHEAD_MS = 0.1
TARGET_N4_RATIO = 2.0
N_PROMPT_TOKENS = 500


class OpenAISender:
    """Streams /v1/chat/completions from the router's HTTP API (see the module docstring)."""

    def __init__(self, client: httpx.AsyncClient, timeout: float, name: str = "openai") -> None:
        self.client = client  # from http_client(): base URL, TLS and bearer token
        self.timeout = timeout
        self.name = name

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        body = {"messages": [{"role": "user", "content": request.prompt}], "max_tokens": request.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body, timeout=self.timeout) as r:
                if r.status_code != 200:
                    record.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    event = json.loads(line[6:])
                    if "error" in event:
                        record.error = event["error"]["message"]
                        return
                    if event.get("usage"):
                        _set_output_tokens(record, event["usage"]["completion_tokens"])
                        record.prompt_tokens = event["usage"]["prompt_tokens"]
                    elif event["choices"] and "content" in event["choices"][0]["delta"]:  # one per token delta
                        record.chunk_times.append(now)
                        record.chunk_tokens.append(1)
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"


def http_client(http_target: str, timeout: float, tls: ClientTLS | None = None,
                token: str | None = None) -> httpx.AsyncClient:
    """An HTTP client for the router's HTTP API at host:port: https with ``tls`` (its CA and, for
    mTLS, its client certificate), ``Authorization: Bearer`` with ``token``."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if tls is None:
        return httpx.AsyncClient(base_url=f"http://{http_target}", timeout=timeout, headers=headers)
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return httpx.AsyncClient(base_url=f"https://{http_target}", timeout=timeout, headers=headers, verify=context)


def _set_output_tokens(record: RequestRecord, total: int) -> None:
    """Chunks were counted 1 each; the usage says how many tokens they held: the rest goes to the
    last chunk (a chunk can hold several tokens when text was held back)."""
    if record.chunk_tokens:
        record.chunk_tokens[-1] += max(total - sum(record.chunk_tokens), 0)


async def measure_api_overhead(grpc_target: str, http_target: str, requests: list[BenchRequest],
                               timeout: float, tls: ClientTLS | None = None, token: str | None = None
                               ) -> dict[str, Any]:
    """The api phase: per-request (HTTP - gRPC) differences of TTFT and time per token."""
    channel = open_channel(grpc_target, tls=tls, retries=0)
    client = http_client(http_target, timeout, tls, token)
    senders: list[Sender] = [_Named(RouterSender(channel, timeout, token), "grpc"), OpenAISender(client, timeout)]
    try:
        await run_alternating(senders, requests[:2])  # warm-up: connections, first-call costs
        runs = await run_alternating(senders, requests)
    finally:
        await client.aclose()
        await channel.close()
    g, h = runs["grpc"], runs["openai"]
    pairs = [(a, b) for a, b in zip(g, h) if a.ok and b.ok]
    ttft = [(b.ttft - a.ttft) * 1e3 for a, b in pairs]
    tpot = [(b.tpot - a.tpot) * 1e3 for a, b in pairs if a.tpot is not None and b.tpot is not None]
    out: dict[str, Any] = {"pairs": len(pairs), "errors": [r.error for r in g + h if r.error][:5],
           "http_ttft_overhead_p50_ms": _median(ttft), "http_per_token_overhead_p50_ms": _median(tpot),
           "http_ttft_overhead_p25_p75_ms": _quartiles(ttft), "http_per_token_overhead_p25_p75_ms": _quartiles(tpot),
           "grpc_ttft_p50_ms": _median([a.ttft * 1e3 for a, _ in pairs]),
           "http_ttft_p50_ms": _median([b.ttft * 1e3 for _, b in pairs]),
           "grpc_tpot_p50_ms": _median([a.tpot * 1e3 for a, _ in pairs if a.tpot is not None]),
           "http_tpot_p50_ms": _median([b.tpot * 1e3 for _, b in pairs if b.tpot is not None])}
    out["ttft_target_met"] = bool(out["http_ttft_overhead_p50_ms"] < TARGET_HTTP_TTFT_OVERHEAD_MS)
    out["per_token_target_met"] = bool(out["http_per_token_overhead_p50_ms"] < TARGET_HTTP_PER_TOKEN_OVERHEAD_MS)
    return out


class _Named:
    def __init__(self, sender: Sender, name: str) -> None:
        self.sender = sender
        self.name = name

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        await self.sender.send(request, record)


def long_prompts(tokenizer: Any, count: int, tokens: int = N_PROMPT_TOKENS) -> list[str]:
    """``count`` distinct prompts of about ``tokens`` tokens (a trial number first, so no two share
    a prefix-cache block), built from the benchmark's prompt file."""
    text = " ".join(load_prompts())
    while len(tokenizer.encode(text)) < tokens:
        text += " " + text
    ids = tokenizer.encode(text)[:tokens]
    body = tokenizer.decode(ids)
    return [f"Trial {i}. Summarize: {body}" for i in range(count)]


async def measure_n_fanout(grpc_target: str, prompts: list[str], max_tokens: int, timeout: float,
                           n: int = 4, prompt_tokens: int = N_PROMPT_TOKENS, tls: ClientTLS | None = None,
                           token: str | None = None) -> dict[str, Any]:
    """The n phase: E2E of n=1 vs n=``n`` on distinct ~500-token prompts, alternating order."""
    channel = open_channel(grpc_target, tls=tls, retries=0)
    stub = duet_pb2_grpc.DuetStub(channel)
    metadata = auth_metadata(token)
    ids = itertools.count()

    async def run(prompt: str, k: int) -> tuple[float, int]:
        request = duet_pb2.GenerateRequest(prompt=prompt, n=k, request_id=f"bench-n-{next(ids)}",
                                           sampling=duet_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.8,
                                                                            seed=1, ignore_eos=True))
        start = time.perf_counter()
        tokens = 0
        try:
            async for r in stub.Generate(request, timeout=timeout, metadata=metadata):
                tokens += len(r.token_ids)
        except grpc.aio.AioRpcError as e:
            raise ValueError(f"n phase: n={k} failed with {e.code().name}: {e.details()}") from None
        return time.perf_counter() - start, tokens

    try:
        await run(prompts[0], 1)  # warm-up (its prompt is not used again)
        one: list[float] = []
        many: list[float] = []
        for i in range(1, len(prompts) // 2):
            a, b = prompts[2 * i], prompts[2 * i + 1]
            order = [(a, 1, one), (b, n, many)] if i % 2 else [(b, n, many), (a, 1, one)]
            for prompt, k, into in order:
                seconds, tokens = await run(prompt, k)
                if tokens != k * max_tokens:  # e.g. the context limit cut the choices short
                    raise ValueError(f"n phase: n={k} gave {tokens} tokens, expected {k * max_tokens} (is "
                                     f"--n-prompt-tokens + --n-max-tokens within the model's context?); "
                                     "--n-trials 0 skips the phase")
                into.append(seconds * 1e3)
    finally:
        await channel.close()
    ratio = _median(many) / _median(one) if one and many else math.nan
    return {"n": n, "trials": len(one), "max_tokens": max_tokens, "prompt_tokens": prompt_tokens,
            "n1_e2e_p50_ms": _median(one), f"n{n}_e2e_p50_ms": _median(many), "ratio": ratio,
            "raw_ms": {"n1": one, f"n{n}": many}, "target_met": bool(ratio < TARGET_N4_RATIO)}


def print_api_report(res: dict[str, Any]) -> None:
    for key, title in (("api_overhead", "HTTP (OpenAI API) vs gRPC, the same router and worker"),
                       ("api_overhead_echo", "HTTP (OpenAI API) vs gRPC against a zero-compute echo worker")):
        o = res.get(key)
        if o:
            print(f"\n{title} ({o['pairs']} closed-loop pairs, median of per-request differences):")
            print(f"  TTFT      {o['http_ttft_overhead_p50_ms']:+.3f} ms  (HTTP {o['http_ttft_p50_ms']:.2f} vs gRPC "
                  f"{o['grpc_ttft_p50_ms']:.2f} ms)  target < {TARGET_HTTP_TTFT_OVERHEAD_MS} ms: "
                  f"{'yes' if o['ttft_target_met'] else 'NO'}")
            print(f"  per token {o['http_per_token_overhead_p50_ms']:+.4f} ms  (HTTP {o['http_tpot_p50_ms']:.3f} vs gRPC "
                  f"{o['grpc_tpot_p50_ms']:.3f} ms)  target < {TARGET_HTTP_PER_TOKEN_OVERHEAD_MS} ms: "
                  f"{'yes' if o['per_token_target_met'] else 'NO'}")
    f = res.get("n_fanout")
    if f:
        many = f[f"n{f['n']}_e2e_p50_ms"]
        print(f"\nn={f['n']} vs n=1 on {f['prompt_tokens']}-token prompts, {f['max_tokens']} tokens per choice "
              f"({f['trials']} trials): E2E p50 {many:.0f} vs {f['n1_e2e_p50_ms']:.0f} ms = "
              f"{f['ratio']:.2f}x  target < {TARGET_N4_RATIO}x: {'yes' if f['target_met'] else 'NO'}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [math.nan, math.nan]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]
