"""The Ray actor shell: a WorkerActor on the session's local Ray cluster serves the gRPC service."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.server.actor import WorkerActor
from workers.config import CacheConfig, EngineConfig
from workers.sampling_params import SamplingParams
from workers.server.service import SERVICE_NAME


async def greedy_over_grpc(endpoint: str, ids: list[int], max_tokens: int) -> tuple[int, list[int]]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        params = worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
        request = worker_pb2.SubmitRequest(request_id="a1", prompt_token_ids=ids, sampling=params)
        tokens = [t async for msg in worker_pb2_grpc.WorkerStub(channel).Submit(request, timeout=60)
                  for t in msg.token_ids]
        return health.status, tokens


async def get_load(endpoint: str) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


async def health_check(endpoint: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_worker_actor_serves_greedy_and_goes_away(ray_cluster, smollm2_path, llm):
    config = EngineConfig(model=str(smollm2_path), cache=CacheConfig(kv_cache_memory_bytes=64 << 20))
    actor = WorkerActor.options(num_cpus=1).remote(config, "w-actor", "127.0.0.1")
    try:
        endpoint = ray.get(actor.start.remote(), timeout=180)
        info = ray.get(actor.info.remote())
        assert ray.get(actor.ready.remote()) and ray.get(actor.endpoint.remote()) == endpoint
        assert info["num_threads"] == 1 and info["worker_id"] == "w-actor"
        load = asyncio.run(get_load(endpoint))  # the context limit the engine enforces: model's, capped by the KV pool
        assert info["max_model_len"] == min(8192, load.kv_blocks_total * load.kv_block_size)

        ids = llm.tokenizer.encode("The capital of France is")
        status, tokens = asyncio.run(greedy_over_grpc(endpoint, ids, 12))
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert tokens == llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0].token_ids

        ray.get(actor.stop.remote(grace=0), timeout=30)
        assert not ray.get(actor.ready.remote())
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing listens there any more
            asyncio.run(health_check(endpoint))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ray.kill(actor)
    # ray.kill is asynchronous: a call made right after it may still be served; within seconds the
    # actor must be gone for good (no restart) and every call fail with RayActorError.
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed actor still answers after 30 s"
        time.sleep(0.1)


def test_worker_actor_runs_with_the_configured_threads(ray_cluster, smollm2_path):
    """The actor started the way a pool starts it (cluster/deploy/pools.py: its thread settings'
    environment in the runtime_env) has every thread at the configured niceness, the OpenMP wait
    policy and the malloc tunables the config names; Ray's own default would be niceness 15."""
    from workers.server.threads import process_env

    for config in (EngineConfig(model=str(smollm2_path)),
                   EngineConfig(model=str(smollm2_path), omp_wait_policy="active", niceness=3,
                                memory_tuning=False)):
        actor = WorkerActor.options(num_cpus=1, runtime_env={"env_vars": process_env(config)}).remote(
            config, "w-threads", "127.0.0.1")
        try:
            info = ray.get(actor.info.remote(), timeout=120)
            assert info["niceness"] == [config.niceness]
            assert info["omp_wait_policy"] == config.omp_wait_policy.upper() and info["num_threads"] == 1
            assert info["glibc_tunables"] == process_env(config).get("GLIBC_TUNABLES")
        finally:
            ray.kill(actor)
