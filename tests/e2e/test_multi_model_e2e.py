"""Two base models in one ``duet serve`` deployment (cluster.deploy.serve.start_deployment on the
session's local Ray): SmolLM2 and a tiny random-weight Llama (tests/testkit/tiny_families.py), one
pool each, addressed by name over gRPC and the OpenAI HTTP API. The tiny model's greedy tokens
through the router equal transformers' ``generate`` on its checkpoint (so its requests ran on its
own pool), SmolLM2's equal a plain SmolLM2 deployment's answer shape; an unknown model is
NOT_FOUND / 404; ListModels, /v1/models and ``duet status`` show both models, their pools and the
config adapter; the adapter admin API answers under its token scopes; an adapter loaded at runtime
(a PEFT adapter made in the test) answers by name with PEFT's merged model's greedy tokens, and an
adapter of a model whose pool runs without LoRA is refused, never run on the base model."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from testkit.pki import ADMIN_TOKEN, GEN_TOKEN, make_pki

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from cluster.deploy.status import format_status, router_status, worker_status
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.client import auth_metadata
from tests.testkit.tiny_families import NEW, PROMPTS, hf_generate, save_tiny
from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SMOL, TINY = "SmolLM2-135M-Instruct", "tiny"
NAMESPACE = "duet_multi_model"


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("multi_model")
    tiny = save_tiny(d / "tiny-llama", smollm2_path, "llama")
    (d / "pki").mkdir()
    pki = make_pki(d / "pki")
    config_file = d / "duet.yaml"
    config_file.write_text(yaml.safe_dump({
        "models": [{"name": SMOL, "dtype": "float32",  # float32: comparable with PEFT's merged model
                    "adapters": [{"name": "sql", "source": str(d / "adapters" / "sql")}]},
                   {"name": str(tiny), "served_name": TINY}],
        "pools": [{"name": "smol", "model": SMOL, "cpus_per_replica": 1,
                   "engine": {"kv_cache_memory_bytes": "16MiB", "block_size": 8, "max_num_batched_tokens": 64,
                              "lora": {"enabled": True, "max_loaded": 2, "max_rank": 8}}},
                  {"name": "tiny", "model": TINY, "cpus_per_replica": 1,
                   "engine": {"kv_cache_memory_bytes": "8MiB", "block_size": 8, "max_num_batched_tokens": 64}}],
        "router": {"port": 0, "http_port": free_port(), "auth_tokens_file": str(pki / "tokens")},
        "controller": {"port": 0, "start_timeout_s": 240}, "ray": {"namespace": NAMESPACE}}))
    deployment = start_deployment(load_config(config_file, env={}), router_overrides=dict(load_poll_interval_s=0.1))
    try:
        yield tiny, deployment
    finally:
        deployment.stop()


def _generate(address: str, model: str, prompt: list[int]) -> list[int]:
    request = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=prompt), model=model,
                                       sampling=duet_pb2.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        responses = duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=120, metadata=auth_metadata(GEN_TOKEN))
        return [t for r in responses for t in r.token_ids]


def test_two_models_served_by_name_over_grpc_and_http(deployment):
    tiny, d = deployment
    prompt = PROMPTS[0]
    assert _generate(d.address, TINY, prompt) == hf_generate(tiny, prompt, NEW)  # ran on the tiny pool
    smol = _generate(d.address, SMOL, prompt)
    assert len(smol) == NEW and smol == _generate(d.address, "", prompt)  # "" = the default model
    assert smol != _generate(d.address, TINY, prompt)
    with pytest.raises(grpc.RpcError) as e:
        _generate(d.address, "gpt-4", prompt)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'gpt-4'" in e.value.details()

    auth = {"authorization": f"Bearer {GEN_TOKEN}"}
    r = httpx.post(f"{d.http_url}/completions", headers=auth, timeout=120, json={
        "model": TINY, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["model"] == TINY, r.text
    assert r.json()["usage"]["completion_tokens"] == NEW
    missing = httpx.post(f"{d.http_url}/chat/completions", headers=auth, timeout=30, json={
        "model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    models = httpx.get(f"{d.http_url}/models", headers=auth, timeout=30).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(SMOL, None), (TINY, None), ("sql", SMOL)]


def test_an_adapter_loaded_at_runtime_serves_requests_by_name(deployment, smollm2_path, tmp_path):
    """The whole path: HTTP load (preloaded on the SmolLM2 worker), then a request naming the adapter
    gives the greedy tokens of PEFT's merged model; the base model's stay the base model's."""
    from tests.testkit.lora_cases import merged_greedy, save_adapter

    _, d = deployment
    adapter = save_adapter(smollm2_path, tmp_path / "chat", seed=7, r=4, targets=["q_proj", "v_proj", "down_proj"])
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    r = httpx.post(f"{d.http_url}/load_lora_adapter", headers=admin, timeout=120,
                   json={"lora_name": "chat", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    prompt = PROMPTS[0]
    want_adapter, want_base = merged_greedy(smollm2_path, adapter, [prompt], NEW)[0], \
        merged_greedy(smollm2_path, None, [prompt], NEW)[0]
    assert want_adapter != want_base  # the adapter changes the answer
    assert _generate(d.address, "chat", prompt) == want_adapter
    assert _generate(d.address, f"{SMOL}:chat", prompt) == want_adapter
    assert _generate(d.address, SMOL, prompt) == want_base
    assert httpx.post(f"{d.http_url}/unload_lora_adapter", headers=admin, timeout=60,
                      json={"lora_name": "chat"}).status_code == 200


def test_status_shows_the_pools_of_each_model(deployment):
    _, d = deployment
    text = format_status({"router": router_status(d.address, token=ADMIN_TOKEN), "workers": worker_status(NAMESPACE),
                          "namespace": NAMESPACE})
    assert f"models {SMOL} (context" in text and f", {TINY} (context" in text, text
    assert f"adapters: sql (on {SMOL})" in text
    assert f"pool smol (model {SMOL}): 1 workers" in text and f"pool tiny (model {TINY}): 1 workers" in text, text


def test_adapter_admin_needs_the_admin_scope(deployment, tmp_path):
    _, d = deployment
    gen, admin = {"authorization": f"Bearer {GEN_TOKEN}"}, {"authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"lora_name": "poet", "lora_path": str(tmp_path / "poet"), "base_model": TINY, "preload": False}
    assert httpx.post(f"{d.http_url}/load_lora_adapter", headers=gen, json=body).status_code == 403
    assert httpx.post(f"{d.http_url}/load_lora_adapter", headers=admin, json=body).status_code == 200
    ids = [(m["id"], m["parent"]) for m in httpx.get(f"{d.http_url}/models", headers=gen).json()["data"]]
    assert ("poet", TINY) in ids
    # never run on the base model instead: workers without LoRA support are refused by the router
    # (FAILED_PRECONDITION), a LoRA worker refuses the missing directory (INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as e:
        _generate(d.address, "poet", PROMPTS[0])
    assert e.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
    # preloading a directory that is no adapter is refused (whichever way the worker refuses it)
    bad = httpx.post(f"{d.http_url}/load_lora_adapter", headers=admin,
                     json={"lora_name": "broken", "lora_path": str(tmp_path / "nothing")})
    assert bad.status_code == 400 and "broken" in bad.json()["error"]["message"]
    assert "broken" not in [m["id"] for m in httpx.get(f"{d.http_url}/models", headers=gen).json()["data"]]
    assert httpx.post(f"{d.http_url}/unload_lora_adapter", headers=admin, json={"lora_name": "poet"}).status_code == 200
    with pytest.raises(grpc.RpcError) as e:
        _generate(d.address, "poet", PROMPTS[0])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert httpx.post(f"{d.http_url}/unload_lora_adapter", headers=admin,
                      json={"lora_name": "poet"}).status_code == 404


def test_duet_generate_picks_the_model_by_name(deployment):
    import subprocess
    import sys

    _, d = deployment

    def run(model: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--target", d.address, "--model", model,
                               "--token", GEN_TOKEN, "--max-tokens", "4", "Hello"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
    ok = run(TINY)
    assert ok.returncode == 0 and "[4 tokens, length" in ok.stderr, ok.stderr
    bad = run("nope")
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr and "unknown model 'nope'" in bad.stderr, bad.stderr
