"""Every architecture family through ``duet serve`` (cluster.deploy.serve.start_deployment on the session's
local Ray): a tiny random-weight checkpoint per family (tests/testkit/tiny_families.py: Qwen3 with
q/k norms + YaRN, Qwen3-MoE, Mistral with a sliding window shorter than the prompt, Gemma 2 with
soft-capping and alternating sliding/global layers, Gemma 3 text, Phi-3 with LongRoPE, DeepSeek-V3
MLA with routed + shared experts and group-limited routing) served by its own deployment under its
own model name gives, through the router's gRPC API, the greedy tokens of transformers' ``generate``
on the same checkpoint; one family is also asked through the OpenAI HTTP API.

A deployment serves one model (``model.name``; the router routes ``GenerateRequest.model`` to it),
so each family gets its own small deployment (1 replica, 1 CPU, an 8 MiB KV pool), started one after
another: the fixture is module-scoped and parametrized, so only one runs at a time.
"""

from __future__ import annotations


import grpc
import httpx
import pytest

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from tests.testkit.tiny_families import CASES, NEW, PROMPTS, hf_generate, save_tiny
from testkit.ports import free_port

FAMILIES = ["qwen3-qknorm-yarn", "qwen3_moe", "mistral-sliding", "gemma2-softcap", "gemma3-local-global",
            "phi3-longrope", "deepseek_v3-mla-grouped"]
HTTP_FAMILY = "qwen3-qknorm-yarn"


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, ray_cluster, smollm2_path, tmp_path_factory):
    """(case, checkpoint path, running deployment) for one family; stopped before the next starts."""
    case = request.param
    arch, overrides = CASES[case]
    path = save_tiny(tmp_path_factory.mktemp("families") / case, smollm2_path, arch, **overrides)
    config = load_config(env={}, overrides={
        "model.name": str(path), "pool.replicas": 1, "pool.cpus_per_replica": 1,
        "pool.engine.kv_cache_memory_bytes": 8 << 20, "pool.engine.block_size": 8,
        "pool.engine.max_num_batched_tokens": 32, "router.port": 0,
        "router.http_port": free_port() if case == HTTP_FAMILY else 0,
        "controller.port": 0, "ray.namespace": f"duet_families_{arch}", "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1))
    try:
        yield case, path, d
    finally:
        d.stop()


def _grpc_generate(address: str, model: str, prompt: list[int]) -> tuple[list[int], str]:
    request = duet_pb2.GenerateRequest(
        prompt_token_ids=duet_pb2.TokenIds(ids=prompt), model=model,
        sampling=duet_pb2.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        responses = list(duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=120))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


def test_greedy_through_serve_equals_transformers(served):
    case, path, d = served
    for prompt in PROMPTS:  # 6 tokens, and 90: longer than every sliding window, prefill in chunks
        tokens, text = _grpc_generate(d.address, path.name, prompt)
        assert tokens == hf_generate(path, prompt, NEW), (case, len(prompt))
    if case == HTTP_FAMILY:  # the same request through the OpenAI HTTP API: the text of those tokens
        r = httpx.post(f"{d.http_url}/completions", timeout=120, json={
            "model": path.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == path.name and body["choices"][0]["text"] == text
        assert body["usage"] == {**body["usage"], "prompt_tokens": len(prompt), "completion_tokens": NEW}
    else:
        assert d.http_url is None
