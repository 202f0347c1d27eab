"""Speculative decoding through the whole stack: `duet serve`'s deployment with a pool whose workers
each own a drafter actor (SmolLM2 int8 drafting for SmolLM2 fp32), driven through the public gRPC
API. Greedy output equals the plain engine's, with speculation on and opted out per request, and
the worker reports its acceptance counters (GetLoad, `duet status`)."""

from __future__ import annotations

import gc

import pytest

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from cluster.deploy.status import format_status, worker_status
from router.client import complete

PROMPT = ("<|im_start|>user\nCopy this list: apples, pears, plums, apples, pears, plums<|im_end|>\n"
          "<|im_start|>assistant\n")
KV_BYTES = 64 << 20
NAMESPACE = "duet_spec_e2e"


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(str(smollm2_path), kv_cache_memory_bytes=KV_BYTES)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))
    ids = list(out.token_ids)
    del llm, out
    gc.collect()
    return ids


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path, reference):
    config = load_config(env={}, overrides={
        "model.name": str(smollm2_path), "pool.replicas": 1, "pool.cpus_per_replica": 1,
        "pool.engine.kv_cache_memory_bytes": KV_BYTES, "router.port": 0, "router.http_port": 0, "controller.port": 0,
        "pool.speculative.method": "draft_model", "pool.speculative.draft_model": str(smollm2_path),
        "pool.speculative.draft_quantization": "int8", "pool.speculative.num_speculative_tokens": 4,
        "pool.speculative.adaptive": False,  # always draft (a same-size drafter rarely pays; this tests the path)
        "ray.namespace": NAMESPACE, "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    d = start_deployment(config, router_overrides=dict(load_poll_interval_s=0.1, load_poll_timeout_s=2.0))
    yield d
    d.stop()


def test_greedy_with_a_drafter_actor_equals_the_engine(deployment, reference):
    out = complete(PROMPT, target=deployment.address, max_tokens=40, temperature=0, timeout=120)
    assert list(out.token_ids) == reference
    off = complete(PROMPT, target=deployment.address, max_tokens=40, temperature=0, timeout=120,
                   num_speculative_tokens=0)
    assert list(off.token_ids) == reference
    [w] = worker_status(NAMESPACE)
    load = w["load"]
    assert load["spec_method"] == "draft_model" and load["spec_verifies"] > 0
    assert 0 < load["spec_accepted_tokens"] <= load["spec_draft_tokens"]
    assert "speculative draft_model: acceptance" in format_status({"workers": [w]})
