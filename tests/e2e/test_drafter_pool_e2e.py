"""Drafter pools end to end through ``duet serve``: a prefill pool (1 worker), a decode pool of two
workers that names a drafter pool, and that drafter pool (two SmolLM2 int8 replicas), all SmolLM2,
on an embedded Ray of this module's own (6 CPUs: more than the test session's 2-CPU cluster).

* M:N: eight concurrent requests (short ones colocated on the decode workers, long ones
  disaggregated) are split by the router between a decode worker and a drafter replica; each
  target drafts on both replicas and each replica batches both targets' rounds; greedy tokens equal
  plain decoding's; ``duet status`` and /metrics show the drafters.
* a seeded request drafting on the pool is reproducible.
* a request migrated mid-stream between the decode workers keeps drafting on its replica.
* a drafter replica killed mid-stream: every stream completes identically, the targets count
  fallbacks, Ray restarts the replica and the controller and router take it back.
* afterwards nothing is left on the drafters (no request state, no KV blocks) and shutdown leaves
  no stream open.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from cluster.deploy.status import format_status, worker_status
from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient
from router.prometheus import metrics_registry
from testkit.waiting import wait_until as _wait

# Not `serial` (that is for a multi-node Ray cluster, whose settings stay in its process): this
# module's embedded Ray is a plain ray.init, and the session's Ray (paused meanwhile,
# session_ray_paused) starts again after it, so it runs beside the rest under xdist.
NAMESPACE = "duet_drafter_pool_e2e"
STORY = ("A lighthouse keeper lived on a small island in the north sea, and every night he climbed the "
         "stairs to light the lamp while the waves broke on the rocks below. ")
PROMPTS = [f"Item {i}: copy this list: apples, pears, plums, apples, pears, plums," for i in range(4)] + \
          [f"{STORY * 2}Chapter {i}. Copy this list: red, green, blue, red, green, blue," for i in range(4)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(str(smollm2_path), kv_cache_memory_bytes=64 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    result = [list(o.token_ids) for o in outs]
    del llm, outs
    gc.collect()
    return result


@pytest.fixture(scope="module")
def deployment(session_ray_paused, smollm2_path, reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("drafters") / "duet.yaml"
    path.write_text(f"""
ray: {{num_cpus: 6, namespace: {NAMESPACE}}}
router: {{port: 0, http_port: 0, policy: least_loaded, disagg_min_prompt_tokens: 48}}
controller: {{port: 0, poll_interval_s: 0.2, start_timeout_s: 600}}
pools:
  - {{name: prefill, role: prefill, replicas: 1, cpus_per_replica: 1, engine: {{kv_cache_memory_bytes: 64MiB}}}}
  - name: decode
    role: decode
    replicas: 2
    cpus_per_replica: 1
    engine: {{kv_cache_memory_bytes: 64MiB}}
    speculative: {{method: draft_model, drafter_pool: drafters, num_speculative_tokens: 4, adaptive: false,
                  draft_timeout_s: 20}}
  - name: drafters
    role: drafter
    replicas: 2
    cpus_per_replica: 1
    engine: {{kv_cache_memory_bytes: 32MiB}}
    drafter: {{model: '{smollm2_path}', quantization: int8}}
""")
    config = load_config(path, env={}, overrides={"model.name": str(smollm2_path)})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1, stream_failure_cooldown_s=0.2))
    yield d
    d.stop()


class Streams:
    """Requests through the router on a background loop: tokens per request, as they arrive."""

    def __init__(self, address: str, prompts: list[str]) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(address, prompts)), daemon=True)
        self._thread.start()

    async def _run(self, address: str, prompts: list[str]) -> None:
        async with DuetClient(address) as client:
            async def one(i: int) -> None:
                try:
                    async for chunk in client.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                                                       ignore_eos=True, timeout=400):
                        self.tokens[i] += chunk.token_ids
                except Exception as e:  # noqa: BLE001 - the test asserts there are none
                    self.errors.append(f"{type(e).__name__}: {e}")
            await asyncio.gather(*(one(i) for i in range(len(prompts))))

    def join(self) -> list[list[int]]:
        self._thread.join(500)
        assert not self._thread.is_alive() and not self.errors, self.errors
        return self.tokens


def _endpoints(d) -> dict[str, str]:
    return dict(d.controller.members())


def _worker_load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def _drafter_load(endpoint: str) -> drafter_pb2.DrafterLoad:
    with grpc.insecure_channel(endpoint) as channel:
        return drafter_pb2_grpc.DrafterStub(channel).GetLoad(drafter_pb2.GetDrafterLoadRequest(), timeout=10)


def _drafters_idle(d) -> bool:
    loads = [_drafter_load(e) for w, e in _endpoints(d).items() if w.startswith("drafters-")]
    return all(ld.num_requests == 0 and ld.kv_blocks_used == 0 for ld in loads)


def test_m_to_n_greedy_equals_plain_and_every_replica_serves_every_target(deployment, reference):
    d = deployment
    assert Streams(d.address, PROMPTS).join() == reference
    eps = _endpoints(d)
    assert sorted(eps) == ["decode-0", "decode-1", "drafters-0", "drafters-1", "prefill-0"]
    for w in ("decode-0", "decode-1"):
        load = _worker_load(eps[w])
        assert load.spec_method == "draft_model" and load.spec_accepted_tokens > 0 and load.spec_fallbacks == 0
    for w in ("drafters-0", "drafters-1"):
        load = _drafter_load(eps[w])
        assert load.num_streams == 2, f"{w}: both targets draft here (M:N)"
        assert load.rounds > 0 and load.batched_rows > load.forward_passes  # rounds batched across requests
    assert _worker_load(eps["prefill-0"]).kv_transfers_sent >= 4  # the long prompts went P/D
    stats = d.router.stats()
    assert stats["policy"]["drafter_routes"] >= len(PROMPTS) and stats["policy"]["drafter_none"] == 0
    _wait(lambda: _drafters_idle(d), 30, "the drafters to release every finished request")
    # duet status and /metrics show the drafter pool like any pool
    text = format_status({"workers": worker_status(NAMESPACE)})
    assert "pool drafters: 2 drafters" in text and "streams 2" in text
    samples = {(s.name, s.labels.get("drafter_id")): s.value
               for m in metrics_registry(d.router.stats).collect() for s in m.samples}
    assert samples[("duet_drafter_rounds_total", "drafters-0")] > 0


def _seeded(address: str, prompt: str, seed: int) -> list[int]:
    async def run() -> list[int]:
        async with DuetClient(address) as client:
            return [t async for chunk in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95,
                                                         seed=seed, ignore_eos=True, timeout=400)
                    for t in chunk.token_ids]
    return asyncio.run(run())


def test_seeded_sampling_through_the_pool_is_reproducible(deployment, reference):
    """A seeded request drafting on the pool gives the same tokens each time it is sent (the
    drafts, their acceptance and the target's own samples all follow the request's seed), and it
    did draft; another seed samples other tokens."""
    d = deployment
    eps = _endpoints(d)
    accepted = sum(_worker_load(eps[w]).spec_accepted_tokens for w in ("decode-0", "decode-1"))
    first = _seeded(d.address, PROMPTS[0], seed=7)
    assert len(first) == MAX_TOKENS and first != reference[0]  # sampled, not greedy
    assert _seeded(d.address, PROMPTS[0], seed=7) == first
    assert _seeded(d.address, PROMPTS[0], seed=8) != first
    assert sum(_worker_load(eps[w]).spec_accepted_tokens for w in ("decode-0", "decode-1")) > accepted
    _wait(lambda: _drafters_idle(d), 30, "the drafters to release the requests")


def _computed(d) -> int:
    return sum(_drafter_load(e).tokens_computed for w, e in _endpoints(d).items() if w.startswith("drafters-"))


def test_a_request_migrated_mid_stream_keeps_its_replica(deployment, reference):
    """The drafter computes about what it computes for the unmigrated run: it kept the request's
    context (a private drafter on the new target would recompute prompt + output so far)."""
    d = deployment
    eps = _endpoints(d)
    before = _computed(d)
    assert Streams(d.address, PROMPTS[:1]).join() == reference[:1]
    unmigrated = _computed(d) - before

    before = _computed(d)
    stream = Streams(d.address, PROMPTS[:1])
    _wait(lambda: len(stream.tokens[0]) >= 12, 200, "the first tokens")
    holder = next(w for w in d.router.stats()["workers"] if w["requests"])
    [rid] = holder["requests"]
    other = next(w for w in ("decode-0", "decode-1") if w != holder["worker_id"])
    with grpc.insecure_channel(eps[holder["worker_id"]]) as channel:
        worker_pb2_grpc.WorkerStub(channel).Migrate(worker_pb2.MigrateRequest(
            request_id=rid, target=worker_pb2.MigrationTarget(worker_id=other, endpoint=eps[other])), timeout=60)
    assert stream.join() == reference[:1]
    assert _worker_load(eps[other]).migrations_in >= 1 and d.router.stats()["requests"]["migrated"] >= 1
    # overlapped windows (k + 1 drafts each): the one the move discarded, and how much of each run's last
    # window was computed before its release arrived; recomputing would cost prompt + 12 tokens more
    prompt_len = len(d.router.server.pipeline.model.tokenizer.encode(PROMPTS[0]))
    assert _computed(d) - before <= unmigrated + 3 * (4 + 1) < unmigrated + prompt_len + 12
    _wait(lambda: _drafters_idle(d), 30, "the drafters to release the request")


def test_a_replica_killed_mid_stream_costs_drafts_not_tokens(deployment, reference):
    d = deployment
    eps = _endpoints(d)
    fallbacks = {w: _worker_load(eps[w]).spec_fallbacks for w in ("decode-0", "decode-1")}
    restarts = d.controller.num_restarts
    streams = Streams(d.address, PROMPTS)
    _wait(lambda: all(len(t) >= 4 for t in streams.tokens), 300, "every request to stream")
    ray.kill(ray.get_actor("drafters-0", namespace=NAMESPACE), no_restart=False)  # Ray restarts it
    assert streams.join() == reference
    assert sum(_worker_load(eps[w]).spec_fallbacks - fallbacks[w] for w in fallbacks) > 0
    _wait(lambda: d.controller.num_restarts > restarts and "drafters-0" in _endpoints(d), 300,
          "the controller to start the restarted replica again")
    _wait(lambda: any(x["drafter_id"] == "drafters-0" and x["healthy"] for x in d.router.stats()["drafters"]),
          60, "the router to take the restarted replica back")
    assert Streams(d.address, PROMPTS[:4]).join() == reference[:4]
    _wait(lambda: _drafters_idle(d), 30, "the drafters to release every request")
