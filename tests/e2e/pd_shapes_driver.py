"""Driver for tests/e2e/test_pd_shapes_e2e.py, run as its own process: it needs more Ray CPUs than
the test session's 2-CPU cluster offers (a prefill and a decode pool of several ranks each), so it
starts `duet serve`'s deployment (cluster.deploy.serve.start_deployment) on an embedded Ray of its own,
runs the checks, stops everything and prints one JSON line with what it saw.

    python tests/e2e/pd_shapes_driver.py CONFIG.yaml MODEL_DIR PAIRS_JSON

PAIRS_JSON: [[prefill worker id, decode worker id], ...]. For each pair, greedy prompts go to the
decode worker's internal Submit naming the prefill worker as ``remote_prefill`` (so every pair of
shapes is exercised, whatever the router's policy would pick); then the same prompts go through
the router's public API. Outputs: the colocated single-process reference, tokens per pair, tokens
through the router, and each worker's load report (KV transfer counters, speculation counters).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys

import grpc

MAX_TOKENS = 16
STORY = ("A lighthouse keeper lived on a small island in the north sea, and every night he climbed the "
         "stairs to light the lamp while the waves broke on the rocks below. ")


def prompts_for(n: int) -> list[str]:
    """n distinct prompts, long enough to be disaggregated by the router (>= 32 tokens)."""
    return [f"{STORY * (1 + i % 2)}Chapter {i + 1}. Copy this list: apples, pears, plums, apples, pears, plums,"
            for i in range(n)]


def reference(model: str, prompts: list[str]) -> list[list[int]]:
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    llm = LLM(model, kv_cache_memory_bytes=32 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = [list(o.token_ids) for o in outs]
    del llm, outs
    gc.collect()
    return tokens


async def _submit(endpoint: str, rid: str, ids: list[int], remote) -> list[int]:
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    sampling = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(endpoint) as channel:
        req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling, remote_prefill=remote)
        return [t async for m in worker_pb2_grpc.WorkerStub(channel).Submit(req, timeout=180) for t in m.token_ids]


async def _load(endpoint: str):
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


async def _checks(d, ids: list[list[int]], prompts: list[str], pairs: list[list[str]]) -> dict:
    from google.protobuf.json_format import MessageToDict

    from protos.duet.worker.v1 import worker_pb2
    from router.client import DuetClient

    endpoints = dict(d.controller.members())
    incarnations = {w: (await _load(e)).incarnation for w, e in endpoints.items()}
    per_pair = {}
    for p, dec in pairs:
        remote = worker_pb2.RemotePrefill(worker_id=p, endpoint=endpoints[p], incarnation=incarnations[p])
        per_pair[f"{p}->{dec}"] = await asyncio.gather(
            *(_submit(endpoints[dec], f"{p}-{dec}-{i}", x, remote) for i, x in enumerate(ids)))
    async with DuetClient(d.address) as client:
        async def one(text: str) -> list[int]:
            return [t async for c in client.generate(text, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                     timeout=180) for t in c.token_ids]
        routed = await asyncio.gather(*(one(t) for t in prompts))
    loads = {w: MessageToDict(await _load(e), preserving_proto_field_name=True) for w, e in endpoints.items()}
    return {"pairs": per_pair, "routed": routed, "loads": loads}


def main(config_path: str, model: str, pairs_json: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoTokenizer

    from cluster.config.duet import load_config
    from cluster.deploy.serve import start_deployment

    pairs = json.loads(pairs_json)
    prompts = prompts_for(3)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer.encode(p) for p in prompts]
    want = reference(model, prompts)
    config = load_config(config_path, env={}, overrides={"model.name": model})
    d = start_deployment(config, log_to_driver=False,
                         router_overrides=dict(load_poll_interval_s=0.1, load_poll_timeout_s=5.0))
    try:
        result = asyncio.run(_checks(d, ids, prompts, pairs))
    finally:
        d.stop()
    print("RESULT " + json.dumps({"reference": want, **result}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
