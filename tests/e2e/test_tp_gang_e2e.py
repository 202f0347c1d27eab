"""A tensor-parallel gang end to end on the session's local Ray cluster: a pool of one replica with
tp_size=2 (two Ray actors x 1 CPU in one placement group, one gloo group whose collectives run on
shared memory, both ranks being on this host) serving SmolLM2 behind
the controller and the router, driven over the public gRPC API. Each rank holds its share of every
layer and caches only its kv heads; the gang answers as one worker with the single-process engine's
greedy tokens (the same leader/follower path as the expert-parallel gang)."""

from __future__ import annotations

import pytest

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from router.client import complete

PROMPT = [1, 504, 3575, 282, 4649, 314]
KV_BYTES = 8 << 20


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(str(smollm2_path), kv_cache_memory_bytes=KV_BYTES)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return list(out.token_ids)


def test_tp_gang_serves_single_rank_tokens(ray_cluster, smollm2_path, reference):
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "pool.replicas": 1, "pool.cpus_per_replica": 1, "pool.tp_size": 2,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "router.port": 0, "router.http_port": 0, "controller.port": 0,
        "ray.namespace": "duet_tp_e2e", "controller.start_timeout_s": 240})
    d = start_deployment(config)
    try:
        assert len(d.pool.replicas[0].followers) == 1
        out = complete(token_ids=PROMPT, target=d.address, max_tokens=16, temperature=0, ignore_eos=True, timeout=120)
        assert list(out.token_ids) == reference
        info = ray_cluster.get(d.pool.replicas[0].actor.info.remote())
        assert info["transports"]["tp"] == "shm"  # both ranks on this host: shared-memory collectives
    finally:
        d.stop()
