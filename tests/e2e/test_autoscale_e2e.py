"""The SLO autoscaler end to end on the session's local Ray cluster (2 CPUs): ``duet serve`` with a
decode pool of one 1-CPU SmolLM2 worker and ``autoscaling`` on (2 s rounds, short windows and
cooldowns). A load ramp makes the autoscaler add a decode replica (a new actor in its own placement
group, which loads, warms up and joins the router); when the ramp stops, a trickle of requests
goes on while the autoscaler removes the replica again -- listed as draining, its running
requests migrate to the other replica (live KV migration), then its actor is killed -- and every
request of the run completes with all its tokens. To be sure the drain has a request to move, one
long request is sent straight to the new worker's internal endpoint (so the router's metrics, and
the autoscaler, never see it): it is still streaming when the drain begins, moves to decode-0
(its stream ends with ``migrated_to`` and the client attaches there, as the router does) and
completes there with every token, before the drained actor is released.

The profile says one replica sustains 2 req/s of 16 output tokens (32 tokens/s at the SLO); the
ramp sends 4 req/s of 16 tokens (two replicas' worth, by the profile), the trickle one 48-token
request every 3 s (half of one, also in the busiest 2 s bucket of a window; each takes seconds,
so the drained replica often still streams one when it is told to drain). The profile is written by the test rather than measured (``duet profile``), so the scaling
does not depend on how busy this shared machine is; the sizing arithmetic is that of
cluster/autoscale/slo.py, on live metrics from the router.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient
from testkit.waiting import wait_until as _wait

NAMESPACE = "duet_autoscale_e2e"
TOKENS = 16
LONG = 1000  # tokens of the request the drain must wait for: the drain begins ~7 s (a 6 s window) after
# the ramp ends, by when it has streamed ~200 here and at most ~600 on a quiet fast machine
PROFILE = {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "decode",
           "slo": {"tpot_p90_s": 2.0},
           "capacity": {"requests_per_s": 2.0, "mean_prompt_tokens": 8.0, "mean_output_tokens": float(TOKENS)}}


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autoscale")
    (tmp / "profile.json").write_text(json.dumps(PROFILE))
    (tmp / "duet.yaml").write_text(f"""
pools:
  - {{name: decode, role: decode, replicas: 1, cpus_per_replica: 1, engine: {{kv_cache_memory_bytes: 134217728}}}}
autoscaling:
  enabled: true
  interval_s: 2
  window_buckets: 3
  latency_buckets: 2
  horizon_s: 2
  up_cooldown_s: 2
  down_cooldown_s: 8
  down_interval_s: 2
  drain_grace_s: 240
  pools:
    - {{pool: decode, slo_tpot_ms: 2000, profile: {tmp / 'profile.json'}, min_replicas: 1, max_replicas: 2}}
""")
    config = load_config(tmp / "duet.yaml", env={}, overrides={
        "model.name": str(smollm2_path), "router.port": 0, "router.http_port": 0, "controller.port": 0, "router.policy": "least_loaded",
        "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1))
    yield d
    d.stop()


class Load:
    """Open-loop Poisson-free load: one request every ``gap_s`` on a background loop; records outcomes."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.results: list[tuple[str, int, int, str]] = []  # (finish reason, tokens, asked, error)
        self.sent = 0
        self.gap_s, self.tokens = 0.25, TOKENS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)
        assert not self._thread.is_alive(), "requests still running 300 s after the load stopped"

    async def _one(self, client: DuetClient, i: int, asked: int) -> None:
        tokens, finish, error = 0, "", ""
        try:
            async for chunk in client.generate(f"Request {i}: count to ten.", max_tokens=asked, temperature=0,
                                               ignore_eos=True, timeout=240):
                tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
        except Exception as e:  # noqa: BLE001 - recorded; the test asserts there are none
            error = f"{type(e).__name__}: {e}"
        self.results.append((str(finish), tokens, asked, error))

    async def _run(self) -> None:
        async with DuetClient(self.address) as client:
            tasks = []
            while not self._stop.is_set():
                tasks.append(asyncio.ensure_future(self._one(client, self.sent, self.tokens)))
                self.sent += 1
                await asyncio.sleep(self.gap_s)
            await asyncio.gather(*tasks)


class Direct:
    """One long greedy request straight to a worker's internal endpoint, on a thread; it follows a
    migration (``migrated_to``) to the target, like the router."""

    def __init__(self, endpoint: str) -> None:
        self.tokens, self.finish, self.error, self.ended_at = 0, None, "", None
        self.migrated_to: list[str] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self._thread.start()

    def _run(self, endpoint: str) -> None:
        prompt, ids, migration_id = [504, 3575, 282, 4649, 314], [], ""
        try:
            while True:
                request = worker_pb2.SubmitRequest(
                    request_id="direct-long", prompt_token_ids=prompt + ids, resumed_output_tokens=len(ids),
                    migration_id=migration_id, sampling=worker_pb2.SamplingParams(
                        max_tokens=LONG - len(ids), temperature=0, top_p=1, ignore_eos=True))
                moved = None
                with grpc.insecure_channel(endpoint) as channel:
                    for msg in worker_pb2_grpc.WorkerStub(channel).Submit(request, timeout=300):
                        ids += msg.token_ids
                        self.tokens = len(ids)
                        self.started.set()
                        if msg.HasField("finish_reason"):
                            self.finish = msg.finish_reason
                        if msg.HasField("migrated_to"):
                            moved = msg.migrated_to
                if moved is None:
                    break
                self.migrated_to.append(moved.worker_id)
                endpoint, migration_id = moved.endpoint, moved.migration_id
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        self.ended_at = time.monotonic()
        self.started.set()

    def join(self) -> None:
        self._thread.join(300)


def test_ramp_adds_a_decode_replica_and_it_drains_away_after(deployment):
    d = deployment
    drained: list[str] = []
    d.controller.subscribe(lambda details: drained.extend(w for w, *_, draining in details if draining),
                           detailed=True)
    assert [w for w, _ in d.controller.members()] == ["decode-0"]
    load = Load(d.address)
    load.start()  # the ramp: 4 req/s
    try:
        _wait(lambda: d.actuator.status("decode").desired == 2, 60, "the autoscaler to ask for a second replica")
        decision = d.autoscaler.last["decode"]
        assert "scale up 1 -> 2" in decision.reason, decision.reason
        _wait(lambda: [w for w, _ in d.controller.members()] == ["decode-0", "decode-1"], 240,
              "decode-1 to load and join")
        _wait(lambda: any(w["worker_id"] == "decode-1" and w["healthy"] for w in d.router.stats()["workers"]), 30,
              "the router to route to decode-1")
        direct = Direct(dict(d.controller.members())["decode-1"])
        assert direct.started.wait(60) and not direct.error, direct.error
        load.gap_s, load.tokens = 3.0, 48  # the ramp ends; a trickle goes on through the scale-down
        _wait(lambda: "decode-1" in drained, 120, "decode-1 to drain")
        assert direct.ended_at is None, f"the long request ended before the drain began ({direct.tokens} tokens)"
        _wait(lambda: d.controller.num_drained == 1, 240, "decode-1 to finish draining and be removed")
        direct.join()
    finally:
        load.stop()
    assert (direct.finish, direct.tokens, direct.error) == (worker_pb2.FINISH_REASON_LENGTH, LONG, "")
    assert direct.migrated_to == ["decode-0"]  # the drain moved it (live migration), it finished there
    assert "decode-1" in drained  # listed as draining (routers stopped sending it work) before it left
    st = d.actuator.status("decode")
    assert (st.desired, st.ready, st.starting, st.pending, st.draining) == (1, 1, 0, 0, 0)
    assert [w for w, _ in d.controller.members()] == ["decode-0"]
    assert {w["worker_id"] for w in d.router.stats()["workers"]} == {"decode-0"}
    errors = [r for r in load.results if r[3]]
    assert not errors, errors[:3]
    incomplete = [r for r in load.results if r[:2] != ("length", r[2])]
    assert len(load.results) == load.sent and not incomplete, incomplete[:3]
