"""Replicas ready in seconds, end to end on the session's local Ray cluster (2 CPUs): ``duet serve``
with one 1-CPU SmolLM2 worker, one standby replica and the node's shared weights directory.

- The pool is scaled to zero; three requests arrive at the router, which holds them and asks the
  controller to wake the pool; the controller promotes the standby, which joins and serves all three
  with the tokens the first worker gave (none lost), and a replacement standby is loaded.
- With no standby left, a request for the pool at zero past its deadline gets UNAVAILABLE naming
  the wait, and over HTTP (a second router with a short router.wake_timeout_s) a 503 naming it; the
  replica the wake started (mapping the node's weights snapshot) then serves the same tokens.
- A standby worker that dies (killed, no restart) is replaced by a newly loaded one.
- /metrics shows the standby count, the promotion and the wake time.
(The router's holding order and deadline arithmetic with fakes: tests/router/test_hold.py; the
controller's standby lifecycle with fake actors, a dead standby replaced: tests/cluster/deploy/
test_standby.py; two replicas of a node sharing one copy of the weights: tests/workers/models/
test_shared_weights.py.)"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re

import grpc
import httpx
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from testkit.waiting import wait_until
from testkit.ports import free_port

NAMESPACE = "duet_coldstart_e2e"
PROMPT = [1, 504, 3575, 282, 4649, 314]
WAKE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, tmp_path_factory):
    node = tmp_path_factory.mktemp("node-weights")
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "model.shared_weights_dir": str(node), "pools[0].standby_replicas": 1,
        "pools[0].cpus_per_replica": 1, "pools[0].engine.kv_cache_memory_bytes": 64 << 20,
        "router.port": 0, "router.http_port": free_port(), "controller.port": 0, "ray.namespace": NAMESPACE,
        "router.wake_timeout_s": WAKE_TIMEOUT_S, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1))
    yield d
    d.stop()


def _generate(address: str, timeout: float = 120.0) -> list[int]:
    request = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=PROMPT), sampling=duet_pb2.SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        return [t for msg in duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=timeout) for t in msg.token_ids]


def _to_zero(d) -> None:
    d.actuator.scale_to("default", 0)
    wait_until(lambda: not d.controller.members() and not any(r["state"] == "draining" for r in d.controller.describe()),
               120, "the pool at zero")


def test_a_pool_at_zero_wakes_from_its_standby_and_serves_the_held_requests(deployment):
    d = deployment
    want = _generate(d.address)
    wait_until(lambda: d.controller.pool_states()["default"]["standby"] == 1, 240, "the standby replica to load")
    _to_zero(d)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: _generate(d.address), range(3)))
    assert outs == [want] * 3  # held, then served by the promoted standby: every request, the same tokens
    assert d.controller.num_promoted == 1 and d.controller.joins[-1][1] == "promoted"
    assert d.waker.num_wakes == 1
    hold = d.router.stats()["hold"]
    assert hold["served_after_hold"] >= 3 and hold["hold_timed_out"] == 0
    metrics = httpx.get(f"{d.http_url[:-3]}/metrics", timeout=10).text
    assert re.search(r'duet_wake_seconds_count\{[^}]*pool="default"[^}]*\} 3\.0', metrics)
    assert re.search(r"duet_pool_standby_promoted_total(\{[^}]*\})? 1\.0", metrics)
    assert re.search(r'duet_pool_join_seconds\{how="promoted"[^}]*\} ', metrics)
    wait_until(lambda: d.controller.pool_states()["default"]["standby"] == 1, 240, "a replacement standby")

    # a standby (a real worker: model loaded, unrouted) that dies is replaced by a new one
    spare = next(r["worker_id"] for r in d.controller.describe() if r["standby"] and r["state"] == "standby")
    ray.kill(d.pools[0].replica(spare).actor, no_restart=True)
    wait_until(lambda: d.controller.num_standby_replaced == 1 and d.controller.pool_states()["default"]["standby"] == 1
               and spare not in {r["worker_id"] for r in d.controller.describe()}, 240, "the dead standby replaced")
    assert [w for w, _ in d.controller.members()] == [d.controller.joins[-1][0]]  # still only the promoted one routed


def test_past_its_wait_a_held_request_gets_unavailable_and_http_503_naming_it(deployment):
    """A wake that starts a new replica (a Ray worker process, imports, the weights mapped) takes
    seconds anywhere: a 0.75 s deadline, and a second router whose router.wake_timeout_s is 0.5 s, give
    up first, deterministically."""
    from router.server import serve_router

    d = deployment
    want = _generate(d.address)
    impatient = serve_router(dataclasses.replace(d.router.server.config, port=0, http_port=free_port(),
                                                 wake_timeout_s=0.5), [])
    try:
        d.controller.set_standby("default", 0)
        wait_until(lambda: d.controller.pool_states()["default"]["standby"] == 0, 60, "no standby")
        _to_zero(d)
        r = httpx.post(f"{impatient.http_url}/completions", timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4})
        with pytest.raises(grpc.RpcError) as err:  # the replica that wake started is still starting
            _generate(d.address, timeout=0.75)
    finally:
        impatient.stop()
    assert r.status_code == 503, r.text
    assert "while pool(s) default woke from zero, until router.wake_timeout_s=0.5 s" in r.text, r.text
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "while pool(s) default woke from zero, until the request's deadline" in err.value.details()
    wait_until(lambda: len(d.controller.members()) == 1, 240, "the woken replica to serve")
    assert _generate(d.address) == want  # the replica the wake started (weights mapped) serves the same tokens
    assert d.controller.joins[-1][1] == "started"
