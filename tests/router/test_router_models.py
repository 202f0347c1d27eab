"""Two models and LoRA adapters behind one router, against fake workers speaking the worker
contract (tests/testkit/router_fakes.py): routed by name over gRPC and HTTP, unknown names
NOT_FOUND / 404, each model's own chat template, ListModels and /v1/models with adapters, adapter
requests carrying their AdapterRef and preferring the worker that holds it, and the adapter admin
API (HTTP and gRPC) behind the admin token scope.

The second model is a tokenizer directory of its own (SmolLM2's vocabulary, another chat
template and context limit): routing needs no weights."""

from __future__ import annotations

import json
import shutil

import grpc
import httpx
import pytest
from testkit.pki import ADMIN_TOKEN, GEN_TOKEN
from testkit.router_fakes import FakeWorker, FakeWorkerServer, LoopThread, SCRIPT, free_port, router_config, \
    run_async, wait_until

from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.client import DuetClient, DuetError, auth_metadata, generate_text
from router.config import AdapterSpec, ModelSpec
from router.server import serve_router

SMOL, TINY = "SmolLM2-135M-Instruct", "tiny"
TINY_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, d / name)
    (d / "chat_template.jinja").write_text(TINY_TEMPLATE)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 256}))
    return d


@pytest.fixture(scope="module")
def workers(tok):
    """s0, s1 serve SmolLM2 (the default model; they speak the LoRA contract), t0, t1 serve tiny
    (no LoRA support: their adapter RPCs answer UNIMPLEMENTED)."""
    lt = LoopThread()
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    servers = {wid: FakeWorkerServer(lt, FakeWorker(wid, ids, tok.eos_token_id)) for wid in ("s0", "s1", "t0", "t1")}
    for s in servers.values():
        s.start()
    yield servers
    for s in servers.values():
        s.stop_sync()
    lt.close()


@pytest.fixture
def router(smollm2_path, tiny_dir, tok, workers, pki):
    for s in workers.values():
        s.worker.reset()
    for wid in ("s0", "s1"):
        workers[wid].worker.lora = True
    cfg = router_config(smollm2_path, http_port=free_port(), auth_tokens_file=str(pki / "tokens"),
                        adapters=(AdapterSpec("sql", "/adapters/sql"),), models=(ModelSpec(TINY, str(tiny_dir)),),
                        load_poll_interval_s=0.05, max_model_len=None)
    members = [(wid, s.endpoint, "colocated", "smol" if wid[0] == "s" else "tiny", False, "", TINY if wid[0] == "t"
                else "") for wid, s in workers.items()]
    with serve_router(cfg, members, tokenizer=tok) as r:
        yield r


def _served_by(workers, ids) -> dict[str, int]:
    return {wid: len(s.worker.submitted) for wid, s in workers.items() if wid in ids}


def _gen(r, model: str, **kw) -> str:
    return generate_text("Hi", target=r.address, model=model, max_tokens=3, temperature=0, timeout=10,
                         token=GEN_TOKEN, **kw)


def test_two_models_are_routed_by_name(router, workers):
    for model in (TINY, TINY, SMOL, "", SMOL):
        assert _gen(router, model)
    assert sum(_served_by(workers, ("t0", "t1")).values()) == 2  # tiny's requests on tiny's workers only
    assert sum(_served_by(workers, ("s0", "s1")).values()) == 3
    with pytest.raises(DuetError) as e:
        _gen(router, "gpt-4", retries=0)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "unknown model 'gpt-4'" in str(e.value)
    assert f"served models: {SMOL}, {TINY}" in str(e.value)
    # every series of a pool carries the model that pool serves (vLLM's model_name label)
    text = httpx.get(f"http://{router.http_address}/metrics", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).text
    pool_lines = [line for line in text.splitlines() if 'pool="' in line and not line.startswith("#")]
    assert any('pool="tiny"' in line for line in pool_lines) and any('pool="smol"' in line for line in pool_lines)
    for line in pool_lines:
        assert (f'model_name="{TINY}"' in line) == ('pool="tiny"' in line), line


def test_list_models_names_every_model_and_adapter(router):
    async def models():
        async with DuetClient(router.address, token=GEN_TOKEN) as client:
            return await client.list_models()
    listed = run_async(models())
    assert [(m.name, m.is_default, m.parent, m.max_model_len) for m in listed] == [
        (SMOL, True, "", 8192), (TINY, False, "", 256), ("sql", False, SMOL, 8192)]
    auth = {"authorization": f"Bearer {GEN_TOKEN}"}
    body = httpx.get(f"http://{router.http_address}/v1/models", headers=auth).json()
    assert [(c["id"], c["parent"], c["root"]) for c in body["data"]] == [
        (SMOL, None, SMOL), (TINY, None, TINY), ("sql", SMOL, "/adapters/sql")]
    assert httpx.get(f"http://{router.http_address}/v1/models/{TINY}", headers=auth).json()["max_model_len"] == 256
    assert httpx.get(f"http://{router.http_address}/v1/models/{SMOL}:sql", headers=auth).json()["parent"] == SMOL
    missing = httpx.get(f"http://{router.http_address}/v1/models/nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_http_uses_each_models_own_chat_template(router, workers, tok):
    auth = {"authorization": f"Bearer {GEN_TOKEN}"}
    url = f"http://{router.http_address}/v1/chat/completions"
    messages = [{"role": "user", "content": "Hello"}]
    r = httpx.post(url, headers=auth, json={"model": TINY, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == TINY
    sent = [req for wid in ("t0", "t1") for req in workers[wid].worker.submitted]
    assert len(sent) == 1 and list(sent[0].prompt_token_ids) == tok.encode("[user] Hello\n[assistant]",
                                                                            add_special_tokens=False)
    r = httpx.post(url, headers=auth, json={"model": SMOL, "messages": messages, "max_tokens": 2})
    smol = [req for wid in ("s0", "s1") for req in workers[wid].worker.submitted]
    assert r.status_code == 200 and len(smol) == 1
    assert list(smol[0].prompt_token_ids) == tok.encode(tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    r = httpx.post(url, headers=auth, json={"model": "nope", "messages": messages})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "unknown model 'nope'" in r.json()["error"]["message"]


def test_adapter_requests_carry_the_adapter_and_prefer_its_holder(router, workers):
    assert _gen(router, "sql")
    first = next(wid for wid in ("s0", "s1") if workers[wid].worker.submitted)
    other = "s1" if first == "s0" else "s0"
    sent = workers[first].worker.submitted[0]
    assert (sent.adapter.name, sent.adapter.source) == ("sql", "/adapters/sql")
    # the worker loaded it on first use; once its load report says so, sql requests stay there
    wait_until(lambda: any(w["adapters"] == ["sql"] for w in router.stats()["workers"]), what="the report")
    for model in ("sql", f"{SMOL}:sql", "sql"):
        assert _gen(router, model)
    assert len(workers[first].worker.submitted) == 4 and not workers[other].worker.submitted
    # base requests are not attracted by it, and carry no adapter
    assert _gen(router, SMOL)
    base = workers[other].worker.submitted[0]
    assert not base.HasField("adapter")
    # the holder is overloaded: the next sql request goes to the other worker, which loads it too
    workers[first].worker.extra_load = 100_000
    wait_until(lambda: any(w["load_tokens"] >= 100_000 for w in router.stats()["workers"]), what="the load")
    assert _gen(router, "sql")
    assert workers[other].worker.submitted[-1].adapter.name == "sql"
    counters = router.stats()["policy"]
    assert counters["adapter_cold"] == 1 and counters["adapter_hits"] == 3
    assert counters["adapter_overload_fallbacks"] == 1


def _http(router, path: str, token: str, body: dict | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"}
    url = f"http://{router.http_address}{path}"
    return httpx.post(url, headers=headers, json=body) if body is not None else httpx.get(url, headers=headers)


def test_admin_api_loads_lists_and_unloads_adapters_over_http(router, workers):
    load = {"lora_name": "chat", "lora_path": "/adapters/chat"}
    denied = _http(router, "/v1/load_lora_adapter", GEN_TOKEN, load)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "insufficient_scope"
    ok = _http(router, "/v1/load_lora_adapter", ADMIN_TOKEN, load)
    assert ok.status_code == 200 and "chat" in ok.text
    loaded = [wid for wid in ("s0", "s1") if "chat" in workers[wid].worker.adapters]
    assert len(loaded) == 1  # preloaded on the least-loaded worker of its base model
    ids = [c["id"] for c in _http(router, "/v1/models", GEN_TOKEN).json()["data"]]
    assert ids == [SMOL, TINY, "chat", "sql"]
    wait_until(lambda: any(a["id"] == "chat" and a["loaded_on"] == loaded
                           for a in _http(router, "/v1/lora_adapters", ADMIN_TOKEN).json()["data"]), what="loaded_on")
    again = _http(router, "/v1/load_lora_adapter", ADMIN_TOKEN, load)
    assert again.status_code == 400 and "already registered" in again.json()["error"]["message"]
    # a bad adapter: the worker's refusal, with its message; nothing is registered
    for wid in ("s0", "s1"):
        workers[wid].worker.bad_sources = {"/bad"}
    bad = _http(router, "/v1/load_lora_adapter", ADMIN_TOKEN, {"lora_name": "broken", "lora_path": "/bad"})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
    assert "broken" not in [c["id"] for c in _http(router, "/v1/models", GEN_TOKEN).json()["data"]]
    # tiny's workers serve no adapters (their reports say so): refused, naming why, none of them asked
    tiny = _http(router, "/v1/load_lora_adapter", ADMIN_TOKEN, {"lora_name": "t", "lora_path": "/a/t", "base_model": TINY})
    assert tiny.status_code == 400 and f"no worker of {TINY} serves LoRA adapters" in tiny.json()["error"]["message"]
    assert not workers["t0"].worker.adapter_calls and not workers["t1"].worker.adapter_calls
    # registered without preload, an adapter of tiny is refused per request: tiny's workers serve none
    lazy = {"lora_name": "t", "lora_path": "/a/t", "base_model": TINY, "preload": False}
    assert _http(router, "/v1/load_lora_adapter", ADMIN_TOKEN, lazy).status_code == 200
    with pytest.raises(DuetError) as e:
        _gen(router, f"{TINY}:t", retries=0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "serves LoRA adapters" in str(e.value)
    assert not any(req.adapter.name for wid in ("t0", "t1") for req in workers[wid].worker.submitted)
    unknown_base = _http(router, "/v1/load_lora_adapter", ADMIN_TOKEN,
                         {"lora_name": "x", "lora_path": "/a/x", "base_model": "nope"})
    assert unknown_base.status_code == 404
    # unload: routing stops at once and the workers drop it
    missing = _http(router, "/v1/unload_lora_adapter", ADMIN_TOKEN, {"lora_name": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"
    assert _http(router, "/v1/unload_lora_adapter", ADMIN_TOKEN, {"lora_name": "sql"}).status_code == 400  # config
    gone = _http(router, "/v1/unload_lora_adapter", ADMIN_TOKEN, {"lora_name": "chat"})
    assert gone.status_code == 200, gone.text
    assert not any("chat" in workers[wid].worker.adapters for wid in ("s0", "s1"))
    with pytest.raises(DuetError) as e:
        _gen(router, "chat", retries=0)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_admin_api_over_grpc_needs_the_admin_scope(router, workers):
    async def call(token: str, method: str, request):
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = control_pb2_grpc.RouterAdminStub(channel)
            return await getattr(stub, method)(request, metadata=auth_metadata(token), timeout=10)

    load = control_pb2.LoadAdapterRequest(name="poet", source="/adapters/poet", pinned=True, preload=True)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run_async(call(GEN_TOKEN, "LoadAdapter", load))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    status = run_async(call(ADMIN_TOKEN, "LoadAdapter", load))
    assert (status.name, status.base_model, status.origin, status.pinned) == ("poet", SMOL, "runtime", True)
    holder = next(wid for wid in ("s0", "s1") if "poet" in workers[wid].worker.adapters)
    assert workers[holder].worker.adapters["poet"].pinned  # pinned travels with the preload
    listed = run_async(call(ADMIN_TOKEN, "ListAdapters", control_pb2.ListAdaptersRequest()))
    assert [(a.name, a.origin) for a in listed.adapters] == [("poet", "runtime"), ("sql", "config")]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run_async(call(ADMIN_TOKEN, "LoadAdapter", control_pb2.LoadAdapterRequest(name="a b", source="/x")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_name" in e.value.details()
    workers[holder].worker.busy_adapters = {"poet"}
    reply = run_async(call(ADMIN_TOKEN, "UnloadAdapter", control_pb2.UnloadAdapterRequest(name=f"{SMOL}:poet")))
    assert list(reply.busy) == [holder]  # still in use there: its LRU drops it; the router routes it no more
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run_async(call(ADMIN_TOKEN, "UnloadAdapter", control_pb2.UnloadAdapterRequest(name="poet")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Generate stays in the generate scope
    async def gen():
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = duet_pb2_grpc.DuetStub(channel)
            return await stub.ListModels(duet_pb2.ListModelsRequest(), metadata=auth_metadata(GEN_TOKEN), timeout=10)
    assert [m.name for m in run_async(gen()).models] == [SMOL, TINY, "sql"]


def test_a_pinned_adapter_is_loaded_pinned_on_every_worker_of_its_model(smollm2_path, tiny_dir, tok, workers):
    for s in workers.values():
        s.worker.reset()
    for wid in ("s0", "s1"):
        workers[wid].worker.lora = True
    cfg = router_config(smollm2_path, adapters=(AdapterSpec("sql", "/adapters/sql", pinned=True),),
                        models=(ModelSpec(TINY, str(tiny_dir)),), load_poll_interval_s=0.05, max_model_len=None)
    members = [(wid, s.endpoint, "colocated", wid[0], False, "", TINY if wid[0] == "t" else "")
               for wid, s in workers.items()]
    with serve_router(cfg, members, tokenizer=tok) as r:
        wait_until(lambda: all("sql" in workers[w].worker.adapters for w in ("s0", "s1")), timeout=10,
                   what="sql pinned on both SmolLM2 workers")
        assert all(workers[w].worker.adapters["sql"].pinned for w in ("s0", "s1"))
        wait_until(lambda: sum(w["adapters"] == ["sql"] for w in r.stats()["workers"]) == 2, what="the reports")
        r.server.adapter_admin._pin_tried.clear()
        r._run(r.server.adapter_admin.keep_pinned(), 10)  # on the router loop; nothing left to do: no second load
    assert [c for w in ("s0", "s1") for c in workers[w].worker.adapter_calls] == [("load", "sql"), ("load", "sql")]
    assert not workers["t0"].worker.adapter_calls and not workers["t1"].worker.adapter_calls  # another model
