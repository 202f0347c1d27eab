"""Disaggregated serving end to end on the session's local Ray cluster: a prefill pool and a decode
pool of one 1-CPU worker each (cluster.deploy.serve.start_deployment), the router pairing them, driven
through the public gRPC API.

Checks, in file order on one deployment: greedy output equals the colocated engine's token for
token (long prompts disaggregated, a short one colocated on the decode worker) with the KV
transfers visible in both workers' load reports; killing the prefill worker while it computes a
prompt fails the request cleanly (UNAVAILABLE, no hang) and returns the decode worker's reserved
blocks; killing the decode worker fails the request with UNAVAILABLE and the prefill worker frees
its state; shutdown leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import gc
import time

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient, DuetError
from testkit.waiting import wait_until as _wait

KV_BYTES = 128 << 20
NAMESPACE = "duet_disagg_e2e"
STORY = ("A lighthouse keeper lived on a small island in the north sea, and every night he climbed the "
         "stairs to light the lamp while the waves broke on the rocks below. ")
PROMPTS = [STORY * 2 + "One night", STORY * 3 + "The keeper", "The capital of France is"]  # last: colocated
HUGE = STORY * 55  # ~2000 tokens: a prefill long enough to kill the worker in the middle of it
# A retried request completes well inside its 120 s timeout (no hang). Generous: the retry prefills all
# ~2000 tokens again on one CPU, which took ~50 s on a loaded 2-core CI machine.
BOUND_S = 100


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(str(smollm2_path), kv_cache_memory_bytes=KV_BYTES)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    result = [list(o.token_ids) for o in outs]
    del llm, outs
    gc.collect()
    return result


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg") / "duet.yaml"
    path.write_text(f"""
pools:
  - {{name: prefill, role: prefill, replicas: 1, cpus_per_replica: 1, engine: {{kv_cache_memory_bytes: {KV_BYTES}}}}}
  - {{name: decode, role: decode, replicas: 1, cpus_per_replica: 1, engine: {{kv_cache_memory_bytes: {KV_BYTES}}}}}
""")
    config = load_config(path, env={}, overrides={
        "model.name": str(smollm2_path), "router.port": 0, "router.http_port": 0, "controller.port": 0, "router.policy": "least_loaded",
        "router.disagg_min_prompt_tokens": 32, "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2,
        "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1, stream_failure_cooldown_s=0.2))
    yield d
    d.stop()


def _load(d, worker_id: str) -> worker_pb2.LoadReport:
    endpoint = dict(d.controller.members())[worker_id]
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def _healthy(d, worker_id: str) -> bool:
    return any(w["worker_id"] == worker_id and w["healthy"] for w in d.router.stats()["workers"])


async def _tokens(address: str, prompts: list[str]) -> list[list[int]]:
    async with DuetClient(address) as client:
        async def one(p: str) -> list[int]:
            return [t async for chunk in client.generate(p, max_tokens=16, temperature=0, timeout=120)
                    for t in chunk.token_ids]
        return await asyncio.gather(*(one(p) for p in prompts))


def test_disaggregated_greedy_equals_colocated(deployment, reference):
    d = deployment
    assert {w[2] for w in d.controller.members_with_roles()} == {"prefill", "decode"}
    assert asyncio.run(_tokens(d.address, PROMPTS)) == reference
    p, dec = _load(d, "prefill-0"), _load(d, "decode-0")
    assert p.kv_transfers_sent == dec.kv_transfers_received == 2  # the short prompt stayed on decode-0
    assert p.kv_bytes_sent == dec.kv_bytes_received > 0 and dec.kv_transfer_failures == 0
    assert d.router.stats()["policy"]["disagg_routes"] == 2


async def _request_and_kill(d, victim: str, when) -> tuple[DuetError | None, float]:
    async with DuetClient(d.address) as client:
        async def request():
            return [c async for c in client.generate(HUGE, max_tokens=8, temperature=0, timeout=120)]
        task = asyncio.ensure_future(request())
        await asyncio.to_thread(_wait, when, 60, f"the moment to kill {victim}")
        ray.kill(ray.get_actor(victim, namespace=NAMESPACE), no_restart=False)
        killed = time.monotonic()
        try:
            await task
        except DuetError as e:
            return e, time.monotonic() - killed
        return None, time.monotonic() - killed


def test_prefill_killed_mid_prefill_is_retried_and_frees_reserved_blocks(deployment):
    # The only prefill worker dies mid-prefill: the router's attempt loop reports it and retries the
    # request colocated on the decode worker (router/policies/disagg.py), so it completes.
    d = deployment
    error, after = asyncio.run(_request_and_kill(d, "prefill-0", lambda: _load(d, "decode-0").num_reserved == 1))
    assert error is None and after < BOUND_S, (error, after)
    _wait(lambda: (lambda r: r.num_reserved == 0 and r.kv_blocks_used == 0)(_load(d, "decode-0")), 15,
          "decode-0 to return its reserved blocks")
    # Ray restarts the prefill worker; the controller re-adds it and disaggregation resumes.
    _wait(lambda: _healthy(d, "prefill-0"), 120, "prefill-0 back in the router")
    assert asyncio.run(_tokens(d.address, PROMPTS[:1]))[0]
    assert _load(d, "prefill-0").kv_transfers_sent == 1


def test_decode_killed_before_the_first_token_is_retried_and_prefill_frees_its_state(deployment):
    # The only decode worker dies before any token reached the client: the attempt loop retries the
    # request once Ray has restarted decode-0 (within worker_wait_s), so it completes.
    d = deployment
    _wait(lambda: _healthy(d, "prefill-0") and _healthy(d, "decode-0"), 120, "both workers in the router")
    def prefill_busy() -> bool:
        r = _load(d, "prefill-0")
        return r.num_running + r.num_waiting > 0
    error, after = asyncio.run(_request_and_kill(d, "decode-0", prefill_busy))
    assert error is None and after < BOUND_S, (error, after)
    _wait(lambda: (lambda r: r.num_running + r.num_waiting == 0 and r.kv_blocks_used == 0)(_load(d, "prefill-0")),
          30, "prefill-0 to free the request")


def test_shutdown_leaves_nothing_behind(deployment):
    d = deployment
    groups = [p.placement_group for p in d.pools]
    d.stop()
    _wait(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE],
          30, "the worker actors to be gone")
    assert all(ray.util.placement_group_table(pg)["state"] == "REMOVED" for pg in groups)
