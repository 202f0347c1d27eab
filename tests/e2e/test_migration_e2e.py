"""Live KV migration end to end through ``duet serve`` (the session's local Ray cluster, 2 CPUs):
one deployment, a decode pool of two 1-CPU SmolLM2 workers, shared by the tests of this module.

* a request streaming through the router is moved mid-stream (the worker's Migrate RPC) to the
  other worker: the client's one stream goes on, and its tokens equal an unmigrated run's, greedy
  and seeded sampling (which a recompute resume could not reproduce);
* scale-down under load: with 8 long generations running, the controller retires decode-1 (what
  the autoscaler's scale-down does): its requests migrate to decode-0 instead of holding the
  drain until they finish; every stream completes identically to an unmigrated run, and the
  worker is released while they still stream.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient
from testkit.waiting import wait_until as _wait

NAMESPACE = "duet_migration_e2e"
PROMPTS = [f"Story {i}: once upon a time, in a land far away," for i in range(8)]


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    (tmp / "duet.yaml").write_text("""
pools:
  - {name: decode, role: decode, replicas: 2, cpus_per_replica: 1, engine: {kv_cache_memory_bytes: 134217728}}
""")
    config = load_config(tmp / "duet.yaml", env={}, overrides={
        "model.name": str(smollm2_path), "router.port": 0, "router.http_port": 0, "controller.port": 0,
        "router.policy": "least_loaded", "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2,
        "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1))
    yield d
    d.stop()


class Streams:
    """Requests through the router on a background loop: tokens per request, as they arrive."""

    def __init__(self, address: str, prompts: list[str], max_tokens: int, **sampling) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(address, prompts, max_tokens, sampling)),
                                        daemon=True)
        self._thread.start()

    async def _run(self, address, prompts, max_tokens, sampling) -> None:
        async with DuetClient(address) as client:
            async def one(i: int) -> None:
                try:
                    async for chunk in client.generate(prompts[i], max_tokens=max_tokens, ignore_eos=True,
                                                       timeout=300, **sampling):
                        self.tokens[i] += chunk.token_ids
                except Exception as e:  # noqa: BLE001 - the test asserts there are none
                    self.errors.append(f"{type(e).__name__}: {e}")
            await asyncio.gather(*(one(i) for i in range(len(prompts))))

    def join(self) -> list[list[int]]:
        self._thread.join(300)
        assert not self._thread.is_alive() and not self.errors, self.errors
        return self.tokens


def _load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_a_request_migrates_mid_stream_and_its_stream_goes_on(deployment, sampling):
    d = deployment
    want = Streams(d.address, PROMPTS[:1], 48, **sampling).join()[0]
    endpoints = dict(d.controller.members())
    stream = Streams(d.address, PROMPTS[:1], 48, **sampling)
    _wait(lambda: len(stream.tokens[0]) >= 6, 120, "the first tokens")
    holder = next(w for w in d.router.stats()["workers"] if w["requests"])
    [rid] = holder["requests"]
    other = next(w for w in endpoints if w != holder["worker_id"])
    with grpc.insecure_channel(endpoints[holder["worker_id"]]) as channel:
        reply = worker_pb2_grpc.WorkerStub(channel).Migrate(worker_pb2.MigrateRequest(
            request_id=rid, target=worker_pb2.MigrationTarget(worker_id=other, endpoint=endpoints[other])), timeout=60)
    got = stream.join()[0]
    assert got == want and len(got) == 48
    assert reply.blocks_sent >= 1 and reply.kv_bytes > 0
    assert d.router.stats()["requests"]["migrated"] >= 1
    assert _load(endpoints[other]).migrations_in >= 1


def test_scale_down_under_load_moves_the_running_requests(deployment):
    d = deployment
    want = Streams(d.address, PROMPTS, 96, temperature=0).join()
    endpoints = dict(d.controller.members())
    assert sorted(endpoints) == ["decode-0", "decode-1"]
    before = _load(endpoints["decode-0"]).migrations_in
    streams = Streams(d.address, PROMPTS, 96, temperature=0)
    _wait(lambda: all(len(t) >= 4 for t in streams.tokens), 120, "every request to stream")
    on_victim = next(w for w in d.router.stats()["workers"] if w["worker_id"] == "decode-1")["requests"]
    assert on_victim, "least_loaded spreads 8 requests over both workers"
    d.controller.retire("decode-1", drain_grace_s=120, drain_settle_s=0.3)
    _wait(lambda: d.controller.num_drained == 1, 120, "decode-1 to drain and be released")
    still_streaming = sum(len(t) < 96 for t in streams.tokens)
    got = streams.join()
    assert got == want
    assert still_streaming > 0, "released only after every request finished: nothing was migrated"
    assert _load(endpoints["decode-0"]).migrations_in - before >= len(on_victim)
    assert [w for w, _ in d.controller.members()] == ["decode-0"]
