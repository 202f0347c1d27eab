"""Duet serving end to end on the session's local Ray cluster: the whole stack in this process
(cluster.deploy.serve.start_deployment: a pool of 2 WorkerActors x 1 CPU, the controller, the router on a
free port), driven through the public gRPC API exactly as a client would.

Tests run in file order on one deployment (it takes ~20 s to start); the worker-kill test and
the shutdown check come last because they change the deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import Deployment, start_deployment
from cluster.deploy.status import worker_status
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient, DuetError, complete
from testkit.waiting import wait_until as _wait

PROMPT = "The capital of France is"
LONG_PROMPT = ("Here is a long story about a lighthouse keeper who lived on a small island in the north sea, "
               "and every night he climbed the stairs to light the lamp. One night")
KV_BYTES = 64 << 20
KILL_TOKENS = 96  # the killed request's length: long enough to be mid-stream when its worker dies
NAMESPACE = "duet_e2e"


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Greedy output of the engine run directly (no Ray, no gRPC) with the workers' settings."""
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(str(smollm2_path), kv_cache_memory_bytes=KV_BYTES)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))
    result = {"token_ids": list(out.token_ids), "text": out.text}
    del llm, out
    gc.collect()
    return result


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, reference):
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "pool.replicas": 2, "pool.cpus_per_replica": 1,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "router.port": 0, "router.http_port": 0, "controller.port": 0, "router.policy": "round_robin",
        "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1, load_poll_timeout_s=2.0,
                                                       stream_failure_cooldown_s=0.5))
    yield d
    d.stop()


def _load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def _idle(d: Deployment) -> bool:
    loads = [_load(ep) for _, ep in d.controller.members()]
    return all(r.kv_blocks_used == 0 and r.num_running == 0 and r.num_waiting == 0 for r in loads)


async def _health_and_models(address: str):
    async with DuetClient(address) as client:
        return await client.health(), await client.health("duet.v1.Duet"), await client.list_models()


def test_health_serving_models_and_status(deployment):
    d = deployment
    overall, duet, models = asyncio.run(_health_and_models(d.address))
    assert overall == duet == "SERVING"
    assert [m.name for m in models] == ["SmolLM2-135M-Instruct"]
    # The router's context limit is the workers' (capped by a 64 MiB KV pool), not the checkpoint's 8192.
    assert models[0].max_model_len == d.max_model_len < 8192
    workers = worker_status(NAMESPACE)
    assert [(w["pool"], w["worker_id"], w["health"]) for w in workers] == [
        ("default", "default-0", "SERVING"), ("default", "default-1", "SERVING")]
    assert {w["endpoint"] for w in workers} == {ep for _, ep in d.controller.members()}
    assert all(w["load"]["kv_blocks_total"] * 16 == d.max_model_len for w in workers)


def test_greedy_over_grpc_equals_the_engine(deployment, reference):
    for _ in range(2):  # round robin: once on each worker
        out = complete(PROMPT, target=deployment.address, max_tokens=24, temperature=0, timeout=120)
        assert list(out.token_ids) == reference["token_ids"]
        assert out.text == reference["text"]
        assert out.finish_reason in ("length", "stop") and out.usage.completion_tokens == len(reference["token_ids"])


async def _stream(client: DuetClient, i: int) -> tuple[int, str | None, int]:
    chunks = [c async for c in client.generate(f"Question {i}: what is {i} plus {i}? Answer:", max_tokens=12,
                                               temperature=0.8, seed=i, timeout=120)]
    return len(chunks), chunks[-1].finish_reason, sum(len(c.token_ids) for c in chunks)


async def _sixteen(address: str):
    async with DuetClient(address) as client:
        return await asyncio.gather(*(_stream(client, i) for i in range(16)))


def test_sixteen_concurrent_streams_complete(deployment):
    results = asyncio.run(_sixteen(deployment.address))
    assert len(results) == 16
    for n_chunks, finish, n_tokens in results:
        assert n_chunks >= 1 and finish in ("stop", "length") and 1 <= n_tokens <= 12
    _wait(lambda: _idle(deployment), 10, "both workers idle after 16 streams")


async def _cancel_mid_stream(address: str) -> int:
    async with DuetClient(address) as client:
        got = 0
        async with contextlib.aclosing(client.generate(LONG_PROMPT, max_tokens=400, ignore_eos=True,
                                                       temperature=0, timeout=120)) as stream:
            async for chunk in stream:
                got += len(chunk.token_ids)
                if got >= 3:
                    break  # aclosing cancels the call: the router cancels the worker's Submit
        return got


async def _deadline(address: str) -> DuetError:
    async with DuetClient(address) as client:
        with pytest.raises(DuetError) as err:
            await client.complete(LONG_PROMPT, max_tokens=400, ignore_eos=True, timeout=1.0)
        return err.value


def test_cancellation_and_deadline_return_every_kv_block(deployment):
    assert asyncio.run(_cancel_mid_stream(deployment.address)) >= 3
    _wait(lambda: _idle(deployment), 10, "kv_blocks_used == 0 on every worker after a cancel")
    assert asyncio.run(_deadline(deployment.address)).code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait(lambda: _idle(deployment), 10, "kv_blocks_used == 0 on every worker after a deadline")


@pytest.mark.parametrize("kwargs, code, field", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    (dict(prompt="hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
    (dict(token_ids=[1] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (dict(prompt="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "model"),
])
def test_bad_input_gets_its_status_naming_the_field(deployment, kwargs, code, field):
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(DuetError) as err:
        complete(prompt, target=deployment.address, timeout=30, **kwargs)
    assert err.value.code == code
    assert err.value.details.startswith(f"{field}:"), err.value.details


async def _stream_until_killed(d: Deployment) -> tuple[str, list[int], str, DuetError | None]:
    """Stream a long greedy completion and kill the worker serving it at the first chunk."""
    async with DuetClient(d.address) as client:
        stream = client.generate(LONG_PROMPT, max_tokens=KILL_TOKENS, ignore_eos=True, temperature=0, timeout=120)
        victim, ids, text = None, [], []
        try:
            async for chunk in stream:
                ids.extend(chunk.token_ids)
                text.append(chunk.text)
                if victim is None:
                    busy = [w["worker_id"] for w in d.router.stats()["workers"] if w["in_flight"]]
                    assert len(busy) == 1, busy
                    victim = busy[0]
                    ray.kill(d.pool.replica(victim).actor, no_restart=False)  # Ray will restart it
        except DuetError as e:
            return victim, ids, "".join(text), e
        return victim, ids, "".join(text), None


def test_worker_killed_mid_stream_resumes_exactly_then_is_restarted_and_readded(deployment):
    d = deployment
    before = dict(d.controller.members())
    victim, ids, text, error = asyncio.run(asyncio.wait_for(_stream_until_killed(d), timeout=90))
    assert victim is not None and error is None, error  # the client never saw the worker die
    assert d.router.stats()["requests"]["resumed"] == 1
    # resumed on the survivor from prompt + streamed tokens: the same greedy output as a run nobody killed
    uninterrupted = complete(LONG_PROMPT, target=d.address, max_tokens=KILL_TOKENS, ignore_eos=True, temperature=0,
                             timeout=120)
    assert list(ids) == list(uninterrupted.token_ids) and len(ids) == KILL_TOKENS
    assert text == uninterrupted.text

    survivor = next(w for w in before if w != victim)
    for _ in range(2):  # later requests succeed (on the survivor while the victim is down)
        out = complete(PROMPT, target=d.address, max_tokens=4, temperature=0, timeout=60)
        assert out.finish_reason == "length"

    # Ray restarts the actor (__init__ only); the controller starts it again and pushes its new endpoint.
    assert d.controller.wait_for(lambda m: dict(m).get(victim) not in (None, before[victim]), timeout=150), \
        d.controller.describe()
    new_endpoint = dict(d.controller.members())[victim]
    assert dict(d.controller.members())[survivor] == before[survivor]
    assert d.controller.num_restarts == 1
    _wait(lambda: any(w["worker_id"] == victim and w["endpoint"] == new_endpoint and w["healthy"]
                      for w in d.router.stats()["workers"]), 30, "the router to route to the restarted worker")
    for _ in range(4):  # round robin: the restarted worker gets requests again
        complete(LONG_PROMPT, target=d.address, max_tokens=2, temperature=0, timeout=60)
    assert _load(new_endpoint).prefix_cache_queries > 0


def test_shutdown_leaves_nothing_behind(deployment):
    d = deployment
    pg = d.pool.placement_group
    d.stop()
    with pytest.raises(DuetError) as err:
        complete(PROMPT, target=d.address, max_tokens=2, timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    _wait(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE],
          30, "the worker actors to be gone")
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    _wait(lambda: ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0), 30,
          "every CPU to be free again")
