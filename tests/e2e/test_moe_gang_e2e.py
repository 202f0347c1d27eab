"""An expert-parallel gang end to end on the session's local Ray cluster: a pool of one replica
with ep_size=2 (two Ray actors x 1 CPU in one placement group, one torch.distributed gloo group)
serving a tiny random Mixtral behind the controller and the router, driven over the public gRPC
API. The gang answers as one worker with the single-process engine's greedy tokens; killing its
follower rank mid-stream fails the stream with UNAVAILABLE (no hang), and the pool recovers: Ray
restarts the ranks, the controller starts the leader again, the gang re-forms and serves the same
tokens. Tests run in file order on one deployment."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient, DuetError, complete

PROMPT = [1, 504, 3575, 282, 4649, 314]
KV_BYTES = 8 << 20
NAMESPACE = "duet_moe_e2e"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    from testkit.mixtral_tiny import save_tiny_mixtral

    return save_tiny_mixtral(tmp_path_factory.mktemp("gang") / "tiny", smollm2_path, seed=2)


@pytest.fixture(scope="module")
def reference(tiny):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(str(tiny), kv_cache_memory_bytes=KV_BYTES)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return list(out.token_ids)


@pytest.fixture(scope="module")
def deployment(ray_cluster, tiny, reference):
    config = load_config(env={}, overrides={
        "model.name": str(tiny), "pool.replicas": 1, "pool.cpus_per_replica": 1, "pool.ep_size": 2,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "router.port": 0, "router.http_port": 0, "controller.port": 0,
        "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    # Router resumption off: these tests check the gang's own failure semantics (its streams end with
    # UNAVAILABLE when a rank dies), which resumption would hide by continuing once the gang re-forms
    # (that path is tested in test_serving_e2e and test_reliability_e2e).
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1, load_poll_timeout_s=2.0,
                                                       stream_failure_cooldown_s=0.5,
                                                       resume_on_worker_failure=False, worker_wait_s=0.0))
    yield d
    d.stop()


def _greedy(address: str) -> list[int]:
    async def run() -> list[int]:
        async with DuetClient(address) as client:
            ids: list[int] = []
            async for chunk in client.generate(token_ids=PROMPT, max_tokens=16, temperature=0,
                                               ignore_eos=True, timeout=60):
                ids += chunk.token_ids
            return ids

    return asyncio.run(run())


def test_gang_serves_as_one_worker_with_single_rank_tokens(deployment, reference):
    assert len(deployment.controller.members()) == 1
    assert len(deployment.pool.replicas[0].followers) == 1
    assert _greedy(deployment.address) == reference
    [(_, endpoint)] = deployment.controller.members()
    with grpc.insecure_channel(endpoint) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert len(load.expert_tokens) == 8 and len(load.ep_rank_tokens) == 2
    assert sum(load.expert_tokens) == sum(load.ep_rank_tokens) > 0


async def _stream_until_follower_killed(d) -> tuple[DuetError | None, float]:
    follower = d.pool.replicas[0].followers[0]
    async with DuetClient(d.address) as client:
        stream = client.generate(token_ids=PROMPT, max_tokens=400, ignore_eos=True, temperature=0, timeout=120)
        killed_at = None
        try:
            async for _ in stream:
                if killed_at is None:
                    ray.kill(follower, no_restart=False)  # Ray will restart it
                    killed_at = time.monotonic()
        except DuetError as e:
            return e, time.monotonic() - killed_at
        return None, time.monotonic() - (killed_at or 0)


def test_rank_death_fails_the_stream_then_the_gang_reforms(deployment, reference):
    d = deployment
    [(victim, before)] = d.controller.members()
    error, after_kill = asyncio.run(asyncio.wait_for(_stream_until_follower_killed(d), timeout=90))
    assert error is not None, "the stream finished although a rank of its gang was killed"
    assert error.code == grpc.StatusCode.UNAVAILABLE and after_kill < 30, (error, after_kill)
    # the leader leaves too; Ray restarts both ranks, the controller starts the leader, the gang re-forms
    assert d.controller.wait_for(lambda m: dict(m).get(victim) not in (None, before), timeout=180), \
        d.controller.describe()
    assert d.controller.num_restarts == 1
    deadline = time.monotonic() + 60
    while True:
        try:
            assert _greedy(d.address) == reference
            break
        except DuetError:
            assert time.monotonic() < deadline, "the re-formed gang never served"
            time.sleep(0.5)


def test_shutdown_releases_every_rank(deployment):
    d = deployment
    actors = [a for r in d.pool.replicas for a in (r.actor, *r.followers)]
    d.stop()
    with pytest.raises(DuetError) as err:
        complete("x", target=d.address, max_tokens=2, timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
