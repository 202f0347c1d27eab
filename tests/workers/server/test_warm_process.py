"""A warm worker process (a standby replica with the pool's ``standby_load: process``): a WorkerActor
on the session's Ray cluster prepared with ``prepare("process")`` has read the model's config and
tokenizer and loaded the kernels but holds no weights; promoted, it loads them (mapped from the
node's snapshot) in that process and serves the same greedy tokens as the plain offline engine.
(The controller passing the pool's standby_load to prepare(): tests/cluster/deploy/test_standby.py.)"""

from __future__ import annotations

import asyncio

import pytest
import ray

from test_worker_actor import greedy_over_grpc
from workers.config import CacheConfig, EngineConfig
from workers.sampling_params import SamplingParams
from workers.server.actor import WorkerActor


def _phases(timeline: dict) -> list[str]:
    return [p for p, _ in timeline["marks"]]


def test_a_warm_process_promoted_serves_the_plain_engines_tokens(ray_cluster, smollm2_path, llm, tmp_path):
    config = EngineConfig(model=str(smollm2_path), shared_weights_dir=str(tmp_path / "node"),
                          cache=CacheConfig(kv_cache_memory_bytes=64 << 20))
    actor = WorkerActor.options(num_cpus=1).remote(config, "w-warm", "127.0.0.1")
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="prepare\\(load='weights'\\): one of model, process"):
            ray.get(actor.prepare.remote("weights"), timeout=60)
        ray.get(actor.prepare.remote("process"), timeout=180)
        ray.get(actor.prepare.remote("process"), timeout=30)  # idempotent
        info = ray.get(actor.info.remote())
        assert info["standby"] and info["endpoint"] is None
        report = ray.get(actor.startup.remote())
        assert _phases(report["prepare"]) == ["resolve", "config", "kernels", "tokenizer"]  # no weights held
        assert report["start"] is None

        endpoint = ray.get(actor.start.remote(), timeout=180)
        report = ray.get(actor.startup.remote())
        # the whole load in the warm process, after the promotion: weights, KV cache, warm-up, serving
        assert _phases(report["start"]) == ["config", "kernels", "weights", "kv", "warm_up", "serve"]
        assert report["start"]["notes"]["weights"] == "loaded+published"  # the node's first: it publishes the snapshot
        assert not ray.get(actor.info.remote())["standby"]

        ids = llm.tokenizer.encode("The capital of France is")
        _, tokens = asyncio.run(greedy_over_grpc(endpoint, ids, 12))
        assert tokens == llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
        ray.get(actor.stop.remote(grace=0), timeout=30)
    finally:
        ray.kill(actor, no_restart=True)
