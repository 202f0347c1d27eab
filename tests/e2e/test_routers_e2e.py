"""``duet serve --routers 2`` on the session's local Ray (two SmolLM2 workers): both routers see the
same workers and the same reported prefix holdings; one router is killed mid-stream under 16
streams (greedy and seeded) and every stream completes, through the Duet client, on the other
router with exactly the output of an unbroken run."""

from __future__ import annotations

import json

import pytest
from testkit.router_fakes import wait_until
from testkit.router_kill import assert_like_unbroken, streams_through_a_kill, unbroken_runs

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from router.client import complete

NAMESPACE = "duet_routers_e2e"
STEM = ("A lighthouse keeper lived alone on a small island in the north sea. Every evening he climbed the "
        "stairs, wound the clockwork and lit the lamp, and every morning he wrote one line in his log. ")
MAX_TOKENS = 16


PROFILE = {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "colocated",
           "slo": {"ttft_p90_s": 5.0, "tpot_p90_s": 2.0},
           "capacity": {"requests_per_s": 2.0, "mean_prompt_tokens": 8.0, "mean_output_tokens": 16.0}}


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routers")
    (tmp / "profile.json").write_text(json.dumps(PROFILE))
    # SLO autoscaling on, bounded to the pool's size (it reads and decides, never resizes here)
    (tmp / "duet.yaml").write_text(f"""
pools:
  - {{name: chat, replicas: 2, cpus_per_replica: 1, engine: {{kv_cache_memory_bytes: 67108864}}}}
autoscaling:
  enabled: true
  interval_s: 1
  window_buckets: 4
  latency_buckets: 2
  pools:
    - {{pool: chat, slo_ttft_ms: 5000, slo_tpot_ms: 2000, profile: {tmp / 'profile.json'}, min_replicas: 2,
       max_replicas: 2}}
""")
    config = load_config(tmp / "duet.yaml", env={}, overrides={
        "model.name": str(smollm2_path), "router.port": 0, "router.http_port": 0, "router.replicas": 2,
        "controller.port": 0, "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2,
        "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1, load_poll_timeout_s=2.0))
    yield d
    d.stop()


def test_the_autoscaler_reads_every_router(deployment):
    d = deployment
    provider = d.autoscaler.provider
    assert len(provider.sources) == 2
    for i in range(4):  # 3 requests through router 0, 1 through router 1
        complete(f"Hello {i}", target=d.routers[0 if i < 3 else 1].address, max_tokens=2, temperature=0, timeout=120)

    def arrived() -> float:
        _, reading = provider.readings[-1]
        return sum(pools["chat"].counters.get("arrived", 0.0) for pools in reading.values() if "chat" in pools)

    wait_until(lambda: bool(provider.readings) and len(provider.readings[-1][1]) == 2 and arrived() == 4.0, what="both routers' counts",
               timeout=10)
    wait_until(lambda: "chat" in d.autoscaler.last, what="a decision on the pool", timeout=10)


def test_routers_share_workers_and_prefix_holdings(deployment):
    d = deployment
    tok = d.router.server.pipeline.model.tokenizer
    assert len(d.routers) == 2 and len(set(d.addresses)) == 2 and d.router is d.routers[0]
    assert [sorted(w["worker_id"] for w in r.stats()["workers"]) for r in d.routers] == \
        [sorted(wid for wid, _ in d.controller.members())] * 2
    ids = tok.encode(STEM)
    complete(token_ids=ids + tok.encode(" Entry one:", add_special_tokens=False), target=d.routers[0].address, max_tokens=2,
             temperature=0, timeout=120)
    indexes = [r.server.prefix_index for r in d.routers]
    wait_until(lambda: all(ix.match(ids) for ix in indexes), what="both routers see the holder", timeout=10)
    assert indexes[0].match(ids) == indexes[1].match(ids)
    holder = next(iter(indexes[1].match(ids)))
    policy = d.routers[1].server.pipeline.policy
    hits = policy.counters()["prefix_hits"]
    complete(token_ids=ids + tok.encode(" Entry two:", add_special_tokens=False), target=d.routers[1].address, max_tokens=2,
             temperature=0, timeout=120)
    assert policy.counters()["prefix_hits"] == hits + 1
    assert any(w["worker_id"] == holder for w in d.routers[1].stats()["workers"])


def test_killing_a_router_mid_stream_loses_no_stream(deployment):
    d = deployment
    doomed, standby = d.routers
    cases = [(f"Story {i}: once upon a time", dict(temperature=0.0) if i % 2 else dict(temperature=0.8, seed=i))
             for i in range(16)]
    expected = unbroken_runs(cases, standby.address, max_tokens=MAX_TOKENS)
    # the router dies with 16 streams in flight
    got, at_kill = streams_through_a_kill(cases, d.addresses, lambda: doomed.stop(0), max_tokens=MAX_TOKENS, min_seen=1)
    # Every greedy stream equals the unbroken reference (the 16 run at once on the standby router); a
    # seeded one may not (testkit/router_kill.py). Seen with references run one at a time: "Story 6"
    # (seed 6) took 2219 for 2211 at index 1 whether that token came before the kill or after the
    # resume, so the batch, not the resume, decides it; the engine does not promise batch-invariant
    # sampling. Such streams are still complete and few.
    assert_like_unbroken(cases, expected, got, at_kill, max_tokens=MAX_TOKENS, max_diverged=1,
                         diverge_before_kill=False)
    assert standby.stats()["requests"].get("client_resumes", 0) == len(cases)
