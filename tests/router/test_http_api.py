"""The OpenAI-compatible HTTP API (router/http_api/) against in-process fake workers
(router_fakes.py): the official ``openai`` SDK (sync and async, streaming and not) and raw HTTP
give the same answers as the gRPC API; every bad input gets OpenAI's error JSON with its status;
a client that disconnects cancels its worker call; /health and /metrics."""

from __future__ import annotations

import json
import ssl

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from testkit.pki import ADMIN_TOKEN, DIGEST_TOKEN, GEN_TOKEN
from testkit.router_fakes import SCRIPT, free_port, members, router_config, run_async, wait_until

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig, RouterConfigError
from router.server import serve_router

MODEL = "SmolLM2-135M-Instruct"


def _config(path, **overrides) -> RouterConfig:
    return router_config(path, **{"http_port": free_port(), "load_poll_timeout_s": 0.5, "worker_failure_threshold": 2,
                                  "stream_failure_cooldown_s": 0.3, **overrides})


@pytest.fixture(scope="module")
def router(smollm2_path, tok, pool):
    handle = serve_router(_config(smollm2_path), members(pool), tokenizer=tok)
    yield handle
    handle.stop(0)


@pytest.fixture(autouse=True)
def clean_pool(pool, router):
    for s in pool:
        s.worker.reset()
        if not s.running:
            s.start()
        s.set_serving(True)
    router.set_members(members(pool))
    wait_until(lambda: all(w["healthy"] for w in router.stats()["workers"]), what="workers healthy")


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=f"http://{router.http_address}", timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(router):
    with openai.OpenAI(base_url=router.http_url, api_key="unused", max_retries=0) as client:
        yield client


def _grpc_text(router, **request) -> duet_pb2.GenerateResponse:
    with grpc.insecure_channel(router.address) as channel:
        responses = list(duet_pb2_grpc.DuetStub(channel).Generate(duet_pb2.GenerateRequest(**request), timeout=30))
    return "".join(r.text for r in responses), responses[-1]


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    if param is not None:
        assert body["error"]["message"].startswith(f"{param}: "), body
    return body["error"]


# -- answers equal the gRPC API's -----------------------------------------------------------------

def test_chat_sdk_sync_equals_grpc(router, sdk):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    expected, last = _grpc_text(router, messages=duet_pb2.ChatMessages(messages=[duet_pb2.ChatMessage(**m)
                                                                                  for m in messages]),
                                sampling=duet_pb2.SamplingParams(max_tokens=12, temperature=0))
    r = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected and expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == last.usage.prompt_tokens
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_sdk_stream_with_usage(router, sdk):
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _grpc_text(router, messages=duet_pb2.ChatMessages(messages=[duet_pb2.ChatMessage(
        role="user", content="Hi")]), sampling=duet_pb2.SamplingParams(max_tokens=20, temperature=0))[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_completion_sdk_async_equals_grpc(router):
    async def go():
        async with openai.AsyncOpenAI(base_url=router.http_url, api_key="x", max_retries=0) as client:
            whole = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=10, temperature=0)
            stream = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=10, temperature=0,
                                                     stream=True)
            parts = [c async for c in stream]
            return whole, parts
    whole, parts = run_async(go())
    expected, _ = _grpc_text(router, prompt="Once upon", sampling=duet_pb2.SamplingParams(max_tokens=10, temperature=0))
    assert whole.object == "text_completion" and whole.choices[0].text == expected
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason == "length"


def test_completion_token_ids_prompt_and_default_max_tokens(router, tok, http):
    ids = tok.encode("Hello there")
    r = http.post("/v1/completions", json={"prompt": ids, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for completions, as the router's
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_raw_sse_framing_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_over_http(router, sdk, tok):
    r = sdk.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0, stop=["wörld"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == "Héllo "


def test_models_endpoint(sdk, http):
    models = sdk.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].object == "model"
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == 512
    _error(http.get("/v1/models/gpt-4"), 404, "model")


def test_user_and_ignored_name_accepted(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "user": "u-1", "max_tokens": 2,
                                                "messages": [{"role": "user", "name": "bob", "content": [
                                                    {"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}]})
    assert r.status_code == 200, r.text


# -- bad input ------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("patch, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 25, "logprobs": True}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": []}, "functions"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_chat_bad_fields_are_400_naming_them(http, patch, param):
    err = _error(http.post("/v1/chat/completions", json={**CHAT, **patch}), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("patch, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": [10**6]}, "prompt[0]"),  # outside the vocabulary: the pipeline's check, renamed
])
def test_completion_bad_fields(http, patch, param):
    _error(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **patch}), 400, param)


def test_malformed_and_non_object_bodies(http):
    err = _error(http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type":
                                                                                   "application/json"}), 400, "body")
    assert err["code"] == "invalid_json"
    _error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400, "body")
    _error(http.post("/v1/chat/completions", content=b""), 400, "body")


def test_unknown_model_is_404(http):
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}), 404, "model")
    assert err["code"] == "model_not_found"


def test_over_long_prompt_is_400_context_length(http):
    err = _error(http.post("/v1/completions", json={"prompt": "word " * 600, "max_tokens": 2}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"


def test_too_large_body_is_413(smollm2_path, tok, pool):
    with serve_router(_config(smollm2_path, max_request_bytes=4096), members(pool), tokenizer=tok) as r:
        big = {"prompt": "x" * 5000, "max_tokens": 2}
        err = _error(httpx.post(f"http://{r.http_address}/v1/completions", json=big), 413, "body")
        assert err["code"] == "request_too_large"
        # chunked upload without a content-length is cut off at the limit as well
        def body():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'
        _error(httpx.post(f"http://{r.http_address}/v1/completions", content=body()), 413, "body")


def test_unknown_path_and_method(http):
    _error(http.get("/v1/nothing"), 404, None)
    assert http.get("/v1/chat/completions").status_code == 405


def test_admission_full_is_429(smollm2_path, tok, pool):
    pool[0].worker.delay_s = 0.2
    with serve_router(_config(smollm2_path, max_in_flight=1, max_queue=0), members(pool[:1]), tokenizer=tok) as r:
        url = f"http://{r.http_address}/v1/completions"
        with httpx.stream("POST", url, json={"prompt": "Hi", "max_tokens": 20, "stream": True}) as first:
            assert first.status_code == 200
            err = _error(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}), 429, None)
            assert err["type"] == "rate_limit_error"


def test_no_workers_is_503_and_health_follows(smollm2_path, tok):
    with serve_router(_config(smollm2_path, worker_wait_s=0), [], tokenizer=tok) as r:
        base = f"http://{r.http_address}"
        assert httpx.get(f"{base}/health").status_code == 503
        err = _error(httpx.post(f"{base}/v1/completions", json={"prompt": "Hi"}), 503, None)
        assert err["type"] == "server_error"


def test_health_serving(http):
    assert http.get("/health").status_code == 200


def test_http_port_validation(smollm2_path):
    with pytest.raises(RouterConfigError, match="^http_port=70000"):
        RouterConfig(tokenizer_path=str(smollm2_path), http_port=70000)
    with pytest.raises(RouterConfigError, match="^http_port=50051: must differ"):
        RouterConfig(tokenizer_path=str(smollm2_path), port=50051, http_port=50051)


def test_busy_http_port_is_a_config_error(smollm2_path, tok, router):
    busy = int(router.http_address.rsplit(":", 1)[1])
    with pytest.raises(RouterConfigError, match=f"^http_port={busy}: cannot listen"):
        serve_router(_config(smollm2_path, http_port=busy), [], tokenizer=tok)


# -- disconnects ----------------------------------------------------------------------------------

def test_disconnect_mid_stream_cancels_the_worker_call(router, pool):
    for s in pool:
        s.worker.delay_s = 0.05
    with httpx.stream("POST", f"http://{router.http_address}/v1/completions",
                      json={"prompt": "Hi", "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # closed after the first event: the router cancels the worker call (the worker frees the KV)
    wait_until(lambda: any(s.worker.cancelled for s in pool), what="the worker call cancelled")
    wait_until(lambda: router.stats()["admission"]["in_flight"] == 0, what="the admission slot released")


def test_disconnect_before_a_whole_response_cancels_it(router, pool):
    for s in pool:
        s.worker.delay_s = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://{router.http_address}/v1/completions", json={"prompt": "Hi", "max_tokens": 200},
                   timeout=0.5)
    wait_until(lambda: any(s.worker.cancelled for s in pool), what="the worker call cancelled")
    wait_until(lambda: router.stats()["admission"]["in_flight"] == 0, what="the admission slot released")


# -- metrics --------------------------------------------------------------------------------------

def _samples(http, name: str) -> dict:
    text = http.get("/metrics").text
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_metrics_parse_carry_model_name_and_move(http):
    before = _samples(http, "duet_router_requests_total")
    assert before and all(dict(k)["model_name"] == MODEL for k in before)
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    after = _samples(http, "duet_router_requests_total")
    assert sum(after.values()) == sum(before.values()) + 1
    ttft = _samples(http, "duet_time_to_first_token_seconds_count")
    assert ttft and all(dict(k)["model_name"] == MODEL for k in ttft) and sum(ttft.values()) >= 1


# -- n, seeds and logprobs ------------------------------------------------------------------------

def test_n_choices_with_seed(router, sdk, pool):
    expected, _ = _grpc_text(router, prompt="Hi", sampling=duet_pb2.SamplingParams(max_tokens=6, temperature=0))
    for s in pool:
        s.worker.reset()
    r = sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=6, n=4, seed=11)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.text == expected and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(pool[0].worker.submitted[0].prompt_token_ids
                                                                            if pool[0].worker.submitted else
                                                                            pool[1].worker.submitted[0].prompt_token_ids)
    seeds = sorted(req.sampling.seed for s in pool for req in s.worker.submitted)
    assert seeds == [11, 12, 13, 14]  # choice i samples with seed + i: the same request reproduces the same choices


def test_n_choices_streamed_chat(sdk):
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finished = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) == 1 and texts[0]
    assert chunks[-1].usage.completion_tokens == 15


def _script_positions(tok, n):
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    return ids[:n]


def test_chat_logprobs(sdk, tok):
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids = _script_positions(tok, 12)
    assert len(content) == 12
    lps = [-0.01 * (i + 1) for i in range(12)]  # testkit.router_fakes.fake_logprob
    assert [c.logprob for c in content] == pytest.approx(lps)
    assert all([t.logprob for t in c.top_logprobs] == pytest.approx([lp, lp - 1, lp - 2]) for c, lp in zip(content, lps))
    assert all(c.top_logprobs[0].token == c.token for c in content)  # the fake's most likely token is the sampled one
    # bytes are exact (a token may hold part of a character); joined they spell the completion
    spelled = b"".join(bytes(c.bytes) for c in content)  # 12 tokens end mid-character, which the text drops
    assert spelled.decode(errors="ignore") == r.choices[0].message.content and spelled.endswith(b"\xe8")
    assert content[0].token == tok.decode([ids[0]])
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    logprobs=True)  # no top_logprobs: the sampled token's logprob only
    assert [len(c.top_logprobs) for c in r.choices[0].logprobs.content] == [0, 0, 0]
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_whole(sdk, http):
    whole = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10, "logprobs": 2}).json()
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 10
    assert lp["token_logprobs"] == pytest.approx([-0.01 * (i + 1) for i in range(10)])
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    streamed = list(sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=10, logprobs=2, stream=True))
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert tokens == lp["tokens"]


# -- security: the gRPC port's tokens and TLS -----------------------------------------------------

def test_bearer_tokens_and_scopes(smollm2_path, tok, pool, pki):
    with serve_router(_config(smollm2_path, auth_tokens_file=str(pki / "tokens")), members(pool), tokenizer=tok) as r:
        base = f"http://{r.http_address}"
        body = {"prompt": "Hi", "max_tokens": 2}
        err = _error(httpx.post(f"{base}/v1/completions", json=body), 401, None)
        assert err["type"] == "authentication_error" and "Bearer" in err["message"]
        _error(httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401, None)
        _error(httpx.get(f"{base}/v1/models", headers={"Authorization": "Basic abc"}), 401, None)
        ok = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {GEN_TOKEN}"})
        assert ok.status_code == 200
        with openai.OpenAI(base_url=r.http_url, api_key=DIGEST_TOKEN, max_retries=0) as client:
            assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
        with openai.OpenAI(base_url=r.http_url, api_key="wrong", max_retries=0) as client, \
                pytest.raises(openai.AuthenticationError):
            client.models.list()
        # /metrics needs the admin scope (as RouterAdmin); /health is open to probes
        err = _error(httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {GEN_TOKEN}"}), 403, None)
        assert err["type"] == "permission_error"
        assert httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
        rejected = r.stats()["requests"]
        assert rejected["auth_unauthenticated"] >= 4 and rejected["auth_permission_denied"] >= 1


def _trust(pki, ca: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki / f"{ca}.pem"))


def test_tls_and_mtls(smollm2_path, tok, pool, pki):
    tls = dict(tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"))
    with serve_router(_config(smollm2_path, **tls), members(pool[:1]), tokenizer=tok) as r:
        assert r.http_url.startswith("https://")
        ok = httpx.post(f"{r.http_url}/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=_trust(pki, "ca"))
        assert ok.status_code == 200
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the router's CA
            httpx.get(f"{r.http_url}/models", verify=_trust(pki, "other_ca"))
    with serve_router(_config(smollm2_path, tls_client_ca_file=str(pki / "ca.pem"), **tls), members(pool[:1]),
                      tokenizer=tok) as r:
        ctx = _trust(pki, "ca")
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        assert httpx.get(f"{r.http_url}/models", verify=ctx).status_code == 200
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):  # no client certificate
            httpx.get(f"{r.http_url}/models", verify=_trust(pki, "ca"))


def test_connections_have_nagle_off(router):
    """TCP_NODELAY on every accepted connection: with Nagle on, the first SSE event written right after
    the response headers waits for the client's delayed ACK (up to 40 ms before the first token)."""
    import socket

    with httpx.stream("POST", f"http://{router.http_address}/v1/completions",
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        connections = list(router.server.http._uvicorn.server_state.connections)
        assert connections
        for conn in connections:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        list(r.iter_lines())
