"""Warm worker processes end to end on the session's local Ray cluster (2 CPUs): ``duet serve`` with one
1-CPU SmolLM2 worker, one standby replica kept as a warm process (``pools[0].standby_load: process``)
and the node's shared weights directory. The standby holds no weights while it waits; the pool is
scaled to zero, a request wakes it, the warm process is promoted, maps the node's snapshot in the
process it already started, and serves the tokens the first worker gave.
(The standby lifecycle with ``standby_load: model``: tests/e2e/test_coldstart_e2e.py.)"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from testkit.waiting import wait_until

NAMESPACE = "duet_warm_process_e2e"
PROMPT = [1, 504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, tmp_path_factory):
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "model.shared_weights_dir": str(tmp_path_factory.mktemp("node-weights")),
        "pools[0].standby_replicas": 1, "pools[0].standby_load": "process", "pools[0].cpus_per_replica": 1,
        "pools[0].engine.kv_cache_memory_bytes": 64 << 20, "router.port": 0, "router.http_port": 0,
        "controller.port": 0, "ray.namespace": NAMESPACE, "router.wake_timeout_s": 120.0,
        "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1))
    yield d
    d.stop()


def _generate(address: str) -> list[int]:
    request = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=PROMPT), sampling=duet_pb2.SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        return [t for msg in duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=180) for t in msg.token_ids]


def _startup(d: Any, worker_id: str) -> dict:
    return ray.get(d.pools[0].replica(worker_id).actor.startup.remote(), timeout=60)


def test_a_pool_at_zero_wakes_from_a_warm_process_that_maps_the_node_weights(deployment):
    d = deployment
    want = _generate(d.address)  # the first worker: loads the weights and publishes the node's snapshot
    wait_until(lambda: d.controller.pool_states()["default"]["standby"] == 1, 240, "the warm process to be ready")
    spare = next(r["worker_id"] for r in d.controller.describe() if r["standby"] and r["state"] == "standby")
    assert [p for p, _ in _startup(d, spare)["prepare"]["marks"]] == [
        "resolve", "config", "kernels", "tokenizer"]  # a warm process: no weights while it waits

    d.actuator.scale_to("default", 0)
    wait_until(lambda: not d.controller.members() and not any(r["state"] == "draining" for r in d.controller.describe()),
               120, "the pool at zero")
    assert _generate(d.address) == want  # held, the warm process promoted, the same greedy tokens
    assert d.controller.joins[-1][:2] == (spare, "promoted")
    start = _startup(d, spare)["start"]
    assert [p for p, _ in start["marks"]] == ["config", "kernels", "weights", "kv", "warm_up", "serve"]
    assert start["notes"]["weights"] == "mapped"  # the node's snapshot, mapped in the process it had started
