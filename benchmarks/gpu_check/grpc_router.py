"""The serving path without Ray: a worker gRPC service in its own process and the router
(router.server, static membership) in this one; 16 concurrent Generate streams through the router
(token-id prompts, greedy) must equal the engine's own tokens (computed in this process first).
fp32, so batch composition (16 streams share decode steps) cannot flip a near-tie."""

from __future__ import annotations

import concurrent.futures as cf

import grpc as grpclib
import torch

from benchmarks.gpu_check import common, models

CUDA_ONLY = False
BUDGET_S = 55.0
STREAMS = 16
NEW = 16


def generate(address: str, prompt: list[int]) -> list[int]:
    from protos.duet.v1 import duet_pb2, duet_pb2_grpc

    req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=prompt),
                                   sampling=duet_pb2.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    with grpclib.insecure_channel(address) as ch:
        for msg in duet_pb2_grpc.DuetStub(ch).Generate(req, timeout=60):
            tokens.extend(msg.token_ids)
    return tokens


def run(ctx) -> dict:
    from transformers import AutoTokenizer

    from router.config import RouterConfig
    from router.server import serve_router

    common.strict_fp32()
    dtype = torch.float32
    path = common.checkpoint(ctx, "smollm2-135m", dtype)
    with common.WorkerProcess(path, ctx, dtype, name="grpc-worker", wait=False) as w:  # loads meanwhile
        eng = common.engine(path, ctx, dtype)
        prompts = models.prompts(STREAMS, eng.spec.vocab_size, 5, 80, seed=51)
        ref = common.greedy(eng, prompts, NEW)
        del eng
        if ctx.cuda:
            torch.cuda.empty_cache()
        w.wait_ready()
        cfg = RouterConfig(tokenizer_path=str(path), port=0, http_port=0)  # gRPC only: no fastapi there
        with serve_router(cfg, [(w.worker_id, w.endpoint)], tokenizer=AutoTokenizer.from_pretrained(path)) as router:
            with cf.ThreadPoolExecutor(STREAMS) as pool:
                got = list(pool.map(lambda p: generate(router.address, p), prompts))
    equal = sum(a == b for a, b in zip(got, ref))
    out = {"streams": STREAMS, "equal": f"{equal}/{STREAMS}", "device": ctx.device}
    out["checks"] = {"streams_equal_engine": equal == STREAMS}
    out["summary"] = f"{equal}/{STREAMS} concurrent router streams equal the engine"
    return out
