"""Draining a worker: live KV migration vs waiting for its requests vs cut-and-recompute, in one run.

    python -m benchmarks.migration_drain [--requests 8] [--context 1000] [--remaining 192] [--repeats 3]

Two worker servers (workers/server/service.py, in this process, no Ray; SmolLM2 on CPU), A and B. Each
trial starts ``--requests`` greedy requests on A with ``--context`` - 8 prompt tokens (distinct
prompts from cluster/bench/data/serving_prompts.txt) and ``--remaining`` + 8 max_tokens; once every
request has streamed 8 tokens (so each holds ``--context`` tokens of KV and is decoding), A is
drained one of three ways, timed from the drain call until A holds no request:
    migrate    Drain(A -> [B]): each request's KV and state move to B, the client attaches there
               (what the router does with ``migrated_to``) and continues at the same token index
    wait       A stops taking requests and its requests run to completion there (the drain
               without migration: ``stop(grace)``)
    recompute  A is stopped at once (grace 0): every stream ends UNAVAILABLE and the client resumes
               it on B from prompt + streamed tokens (the router's resume: B prefills all of it)
For each: drain seconds (median over --repeats), the extra tokens computed because of the drain
(recompute: the prompt + streamed tokens B prefilled, minus its prefix-cache hits, from the final
usage; migrate and wait: none), the longest stall one client saw between two tokens around the
drain, and whether every request's tokens equal the wait trial's (greedy: they must).

Machine: the box is shared (other tenants use its cores); run it under the heavy lock and compare
the three ways within one run. Writes JSON to --out (default benchmarks/results/migration_drain.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "migration_drain.json"
PROMPTS_FILE = REPO_ROOT / "cluster" / "bench" / "data" / "serving_prompts.txt"
WARM = 8  # tokens each request streams before the drain

logger = logging.getLogger(__name__)


class Client:
    """One request's stream, following migrated_to (attach) and resuming on B after a failure, like
    the router. Records tokens, the arrival time of each chunk and the recompute it caused."""

    def __init__(self, rid: str, ids: list[int], max_tokens: int) -> None:
        self.rid, self.ids, self.max_tokens = rid, ids, max_tokens
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.recomputed = 0
        self.warm = asyncio.Event()

    async def run(self, endpoint: str, fallback: str) -> None:
        from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

        migration_id, resumed = "", False
        while True:
            n = len(self.tokens)
            req = worker_pb2.SubmitRequest(
                request_id=self.rid, prompt_token_ids=self.ids + self.tokens, resumed_output_tokens=n,
                migration_id=migration_id, sampling=worker_pb2.SamplingParams(
                    max_tokens=self.max_tokens - n, temperature=0.0, top_p=1.0, ignore_eos=True))
            moved = None
            try:
                async with grpc.aio.insecure_channel(endpoint) as channel:
                    async for m in worker_pb2_grpc.WorkerStub(channel).Submit(req):
                        if m.token_ids:
                            self.tokens += m.token_ids
                            self.times.append(time.monotonic())
                            if len(self.tokens) >= WARM:
                                self.warm.set()
                        if m.HasField("migrated_to"):
                            moved = m.migrated_to
                        elif m.HasField("finish_reason"):
                            if resumed:  # B prefilled prompt + streamed tokens, less its prefix-cache hits
                                self.recomputed += len(req.prompt_token_ids) - m.usage.cached_prompt_tokens
                            return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                endpoint, migration_id, resumed = fallback, "", True  # the router's resume by recompute
                continue
            assert moved is not None
            endpoint, migration_id = moved.endpoint, moved.migration_id

    def stall_s(self, t0: float) -> float:
        """Longest gap between two tokens from the drain on (0 if none arrived after it)."""
        after = [t for t in self.times if t >= t0]
        before = [t for t in self.times if t < t0]
        points = before[-1:] + after
        return max((b - a for a, b in zip(points, points[1:])), default=0.0)


async def trial(mode: str, config: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    from protos.duet.worker.v1 import worker_pb2
    from workers.server.service import start_worker_server

    a = await start_worker_server(config, worker_id=f"drain-a-{tag}", kv_transfer_timeout_s=60)
    b = await start_worker_server(config, worker_id=f"drain-b-{tag}", kv_transfer_timeout_s=60)
    try:
        clients = [Client(f"{tag}-{i}", ids, max_tokens) for i, ids in enumerate(prompts)]
        tasks = [asyncio.ensure_future(c.run(a.endpoint, b.endpoint)) for c in clients]
        await asyncio.gather(*(c.warm.wait() for c in clients))
        t0 = time.monotonic()
        if mode == "migrate":
            target = worker_pb2.MigrationTarget(worker_id=b.worker_id, endpoint=b.endpoint, incarnation=b.incarnation)
            reply = await a.servicer.drain([target], 300.0)
            assert reply.remaining == 0, reply
            drained = time.monotonic() - t0
        elif mode == "wait":
            await a.stop(grace=600.0)
            drained = time.monotonic() - t0
        else:
            await a.stop(grace=0.0)
            drained = time.monotonic() - t0
        await asyncio.gather(*tasks)
        done = time.monotonic() - t0
        return {"mode": mode, "drain_s": drained, "all_done_s": done,
                "extra_tokens_computed": sum(c.recomputed for c in clients),
                "max_stall_s": max(c.stall_s(t0) for c in clients),
                "tokens": [c.tokens for c in clients]}
    finally:
        await a.stop(grace=0.0)
        await b.stop(grace=0.0)


def load_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    lines = [x for x in PROMPTS_FILE.read_text().splitlines() if x.strip()]
    out = []
    for i in range(n):
        ids: list[int] = tokenizer.encode(f"Request {seed}-{i}. ")
        j = i * 7
        while len(ids) < length:
            ids += tokenizer.encode(" " + lines[j % len(lines)])
            j += 1
        out.append(ids[:length])
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from workers.config import CacheConfig, EngineConfig
    from workers.models.assets.resolve import resolve_model

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kv_bytes = args.requests * (args.context + args.remaining + 64) * 47_000 + (64 << 20)
    config = EngineConfig(model=str(path), cache=CacheConfig(kv_cache_memory_bytes=kv_bytes))
    results: dict[str, list[dict[str, Any]]] = {"migrate": [], "wait": [], "recompute": []}
    for r in range(args.repeats):
        prompts = load_prompts(tokenizer, args.requests, args.context - WARM, seed=r)
        for mode in results:
            res = await trial(mode, config, prompts, args.remaining + WARM, f"{mode}{r}")
            logger.info("repeat %d %s: drain %.2f s, extra tokens %d, max stall %.2f s", r, mode, res["drain_s"],
                        res["extra_tokens_computed"], res["max_stall_s"])
            results[mode].append(res)
    summary: dict[str, Any] = {}
    for mode, runs in results.items():
        summary[mode] = {"drain_s_median": statistics.median(x["drain_s"] for x in runs),
                         "all_done_s_median": statistics.median(x["all_done_s"] for x in runs),
                         "extra_tokens_computed_median": statistics.median(x["extra_tokens_computed"] for x in runs),
                         "max_stall_s_median": statistics.median(x["max_stall_s"] for x in runs),
                         "drain_s": [round(x["drain_s"], 3) for x in runs]}
    for mode in ("migrate", "recompute"):
        summary[mode]["tokens_equal_wait"] = all(x["tokens"] == w["tokens"]
                                                 for x, w in zip(results[mode], results["wait"]))
    summary["ratio_wait_over_migrate"] = summary["wait"]["drain_s_median"] / summary["migrate"]["drain_s_median"]
    return {"date": time.strftime("%Y-%m-%d"), "model": args.model, "requests": args.requests,
            "context_tokens": args.context, "remaining_tokens": args.remaining, "repeats": args.repeats,
            "device": "cpu", "summary": summary}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="migration_drain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--context", type=int, default=1000, help="tokens each request holds at the drain")
    p.add_argument("--remaining", type=int, default=192, help="tokens each request still generates after it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.context <= WARM or args.remaining < 1 or args.repeats < 1:
        raise SystemExit(f"--requests >= 1, --context > {WARM}, --remaining >= 1, --repeats >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("workers").setLevel(logging.WARNING)
    report = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
