"""The official ``openai`` SDK against a real ``duet serve`` (cluster.deploy.serve.start_deployment on the
session's local Ray: one SmolLM2 worker, the router with its HTTP API on a free port), as an
application written for OpenAI would use it with only the base URL changed. Answers equal the gRPC
API's for the same request; logprobs of greedy tokens equal log_softmax of an independent HF
transformers forward pass; a disconnect frees the worker's KV blocks; /metrics moves with traffic.
One deployment for the module (~20 s to start).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import complete

from testkit.tolerance import LOGPROB_ACROSS_BATCHES, LOGPROB_VS_HF
from testkit.ports import free_port

MODEL = "SmolLM2-135M-Instruct"
KV_BYTES = 64 << 20
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path):
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "pool.replicas": 1, "pool.cpus_per_replica": 1,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "router.port": 0, "router.http_port": free_port(),
        "controller.port": 0, "ray.namespace": "duet_openai_e2e", "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def sdk(deployment):
    with openai.OpenAI(base_url=deployment.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def _grpc(d, **request) -> list[duet_pb2.GenerateResponse]:
    with grpc.insecure_channel(d.address) as channel:
        return list(duet_pb2_grpc.DuetStub(channel).Generate(duet_pb2.GenerateRequest(**request), timeout=120))


def _chat_messages() -> duet_pb2.ChatMessages:
    return duet_pb2.ChatMessages(messages=[duet_pb2.ChatMessage(**m) for m in CHAT])


def test_chat_equals_grpc_sync_sdk(deployment, sdk):
    expected = _grpc(deployment, messages=_chat_messages(), sampling=duet_pb2.SamplingParams(max_tokens=24,
                                                                                            temperature=0))
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0)
    assert r.choices[0].message.content == "".join(x.text for x in expected) and r.choices[0].message.content
    assert r.usage.completion_tokens == expected[-1].usage.completion_tokens
    assert r.usage.prompt_tokens == expected[-1].usage.prompt_tokens
    # the same prompt again: the prefix cache served (most of) it, and usage says so
    again = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_equals_grpc_async_sdk_streaming(deployment):
    prompt = "The capital of France is"
    expected = complete(prompt, target=deployment.address, max_tokens=20, temperature=0, timeout=120).text

    async def go():
        async with openai.AsyncOpenAI(base_url=deployment.http_url, api_key="x", max_retries=0) as client:
            whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return whole, chunks
    whole, chunks = asyncio.run(go())
    assert whole.choices[0].text == expected
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n4_with_seed_is_reproducible(sdk):
    def ask():
        r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, n=4, seed=7, temperature=1.0)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)], r.usage
    first, usage = ask()
    second, _ = ask()
    assert len(first) == 4 and first == second
    assert len(set(first)) > 1  # four samples, not one repeated (seed + i per choice)
    assert usage.completion_tokens <= 4 * 16 and usage.completion_tokens >= 4


def test_greedy_logprobs_equal_hf_log_softmax_and_grpc(deployment, sdk, smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "Water boils at"
    r = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    grpc_out = _grpc(deployment, prompt=prompt, sampling=duet_pb2.SamplingParams(max_tokens=8, temperature=0,
                                                                                 top_logprobs=5))
    grpc_lps = [x for resp in grpc_out for x in resp.logprobs]
    assert lp.token_logprobs == LOGPROB_ACROSS_BATCHES.approx([x.logprob for x in grpc_lps])  # two requests
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), torch_dtype=torch.float32).eval()
    prompt_ids = tok.encode(prompt)
    generated = [x.token_id for x in grpc_lps]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0]  # [T, vocab]
    ref = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)  # [n_out, vocab]: each generated token's position
    expected = ref[torch.arange(len(generated)), torch.tensor(generated)]
    assert lp.token_logprobs == LOGPROB_VS_HF.approx(expected.tolist())
    # the top-5 alternatives are HF's top 5 at each position (greedy: the generated token is first)
    for i, top in enumerate(lp.top_logprobs):
        hf_top = torch.topk(ref[i], 5)
        assert list(top.values()) == LOGPROB_VS_HF.approx(hf_top.values.tolist())
        assert lp.tokens[i] == next(iter(top))


def _kv_used(d) -> int:
    [(_, endpoint)] = d.controller.members()
    with grpc.insecure_channel(endpoint) as channel:
        r = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return r.kv_blocks_used + r.num_running + r.num_waiting


def test_disconnect_mid_stream_frees_kv_blocks(deployment):
    with httpx.stream("POST", f"{deployment.http_url}/completions", timeout=60,
                      json={"prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _kv_used(deployment) > 0  # the request holds blocks on the worker now
    deadline = time.monotonic() + 15
    while _kv_used(deployment) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _kv_used(deployment) == 0


def test_metrics_parse_and_move(deployment, sdk):
    def finished() -> float:
        text = httpx.get(f"{deployment.http_url[:-3]}/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "duet_requests_finished_total" and s.labels.get("model_name") == MODEL)
    before = finished()
    sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert finished() == before + 1
    assert httpx.get(f"{deployment.http_url[:-3]}/health", timeout=10).status_code == 200
