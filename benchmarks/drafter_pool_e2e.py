"""Drafter pool end to end (issue 31, benchmark (c)): Qwen2.5-Coder-1.5B target, 0.5B drafter, through
``duet serve``: tokens/s with a drafter pool vs no speculation vs the private drafter actor.

Two deployments, one after the other, each on an embedded Ray of 2 CPUs (this machine's 2 cores cap it:
the target's worker gets 1 CPU, the drafter 1):

    private   pool ``main`` (1 replica, 1 CPU) with ``speculative: {method: draft_model, draft_model:
              <0.5B>}``: its own drafter actor (1 CPU)
    pool      pool ``main`` (1 replica, 1 CPU) with ``speculative: {method: draft_model, drafter_pool:
              drafters}`` and pool ``drafters`` (1 replica of the 0.5B, 1 CPU)

In each, the *plain* arm is the same deployment with speculation off per request
(``num_speculative_tokens=0``): the same worker and weights, the drafter idle. Rounds alternate
plain and speculative on the same prompts, at each concurrency (1 = one request at a time; 8 = eight
at once), greedy, ``--max-tokens`` new tokens with EOS ignored; every speculative output is compared
with the first plain one, and so is every later plain round (``plain_mismatches``: plain decoding at
a batch is only as repeatable as its batch shapes, which arrival timing changes). Tokens/s = the
round's output tokens / its wall time; medians over ``--repeats``.
Each speculative round also records the target's speculation counters (verifies, draft tokens,
accepted, fallbacks, seconds waiting for drafts and verifying: what the adaptive draft length chose
and what it saw), in the JSON's ``spec_counters``.

    python -m benchmarks.drafter_pool_e2e [--quantization q4] [--concurrency 1 8] [--repeats 3]

Needs the Qwen pair (``make qwen-coder``). JSON: benchmarks/results/drafter_pool_e2e.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from cluster.config.duet import DuetConfig
from cluster.deploy.serve import start_deployment
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient

logger = logging.getLogger("drafter_pool_e2e")

TARGET, DRAFT = "Qwen2.5-Coder-1.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct"
PROMPTS = [  # code tasks whose answers a 0.5B coder drafts well
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a Python function that counts the words in a text file and returns the 10 most common.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that parses a CSV line with quoted fields into a list of strings.",
    "Write a Python function that returns all prime numbers below n with the sieve of Eratosthenes.",
]


def config(arm: str, quantization: str, kv: str) -> DuetConfig:
    main: dict[str, Any] = {"name": "main", "replicas": 1, "cpus_per_replica": 1,
                            "engine": {"kv_cache_memory_bytes": kv}}
    pools = [main]
    if arm == "private":
        main["speculative"] = {"method": "draft_model", "draft_model": DRAFT, "draft_quantization": quantization,
                               "drafter_cpus": 1}
    else:
        main["speculative"] = {"method": "draft_model", "drafter_pool": "drafters"}
        pools.append({"name": "drafters", "role": "drafter", "replicas": 1, "cpus_per_replica": 1,
                      "engine": {"kv_cache_memory_bytes": kv}, "drafter": {"model": DRAFT, "quantization": quantization}})
    return DuetConfig.model_validate({
        "model": {"name": TARGET, "quantization": quantization}, "pools": pools,
        "router": {"port": 0, "http_port": 0}, "controller": {"port": 0}, "ray": {"num_cpus": 2}})


async def one_round(address: str, prompts: list[str], max_tokens: int, spec: bool) -> tuple[float, int, list]:
    kwargs: dict[str, Any] = {} if spec else {"num_speculative_tokens": 0}
    async with DuetClient(address) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.complete(messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                                                      temperature=0, ignore_eos=True, timeout=1800, **kwargs)
                                      for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return wall, tokens, [list(o.token_ids) for o in outs]


SPEC_COUNTERS = ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens", "spec_fallbacks",
                 "spec_draft_seconds", "spec_verify_seconds")


def spec_counters(endpoint: str) -> dict[str, float]:
    """The target worker's speculation counters (since start): verifies, drafts, accepted, fallbacks,
    seconds waiting for drafts, seconds of steps that verified drafts."""
    with grpc.insecure_channel(endpoint) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
    return {k: round(float(getattr(load, k)), 3) for k in SPEC_COUNTERS}


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    d = start_deployment(config(arm, args.quantization, args.kv_cache), log_to_driver=False)
    try:
        assert d.controller is not None
        target = dict(d.controller.members())["main-0"]
        out: dict[str, Any] = {}
        for c in args.concurrency:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
            asyncio.run(one_round(d.address, prompts[:1], 8, True))  # warm-up: both engines, the stream
            rows: dict[str, list[float]] = {"plain": [], "spec": []}
            counters: list[dict[str, float]] = []  # per speculative round: what the adaptive policy did
            mismatches, plain_mismatches, ref = 0, 0, None
            for r in range(args.repeats):
                for side in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                    c0 = spec_counters(target)
                    wall, tokens, ids = asyncio.run(one_round(d.address, prompts, args.max_tokens, side == "spec"))
                    delta = {k: round(v - c0[k], 3) for k, v in spec_counters(target).items()}
                    rows[side].append(tokens / wall)
                    if side == "plain":
                        plain_mismatches += ref is not None and ids != ref  # plain decoding against itself
                        ref = ref or ids
                    else:
                        counters.append(delta)
                    logger.info("%s c=%d %s: %.2f tok/s (%d tokens in %.1f s; load %.1f) %s", arm, c, side,
                                tokens / wall, tokens, wall, os.getloadavg()[0], delta)
                    if side == "spec" and ref is not None and ids != ref:
                        mismatches += 1
            out[str(c)] = {side: {"tok_s": v, "median": statistics.median(v)} for side, v in rows.items()}
            out[str(c)]["spec_counters"] = counters
            out[str(c)]["greedy_mismatches"] = mismatches
            out[str(c)]["plain_mismatches"] = plain_mismatches
            out[str(c)]["speedup"] = out[str(c)]["spec"]["median"] / out[str(c)]["plain"]["median"]
        return out
    finally:
        d.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="q4", choices=["none", "int8", "q4"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache", default="256MiB")
    p.add_argument("--arms", nargs="+", default=["private", "pool"], choices=["private", "pool"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/drafter_pool_e2e.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    load_before = os.getloadavg()
    arms = {arm: run_arm(arm, args) for arm in args.arms}
    result = {"arms": arms, "target": TARGET, "draft": DRAFT,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "loadavg": {"before": load_before, "after": os.getloadavg()}, "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for arm, per_c in arms.items():
        for c, r in per_c.items():
            print(f"{arm:8} c={c}: plain {r['plain']['median']:.2f} tok/s, spec {r['spec']['median']:.2f} tok/s "
                  f"({r['speedup']:.2f}x), greedy mismatches {r['greedy_mismatches']} "
                  f"(plain rounds vs the first: {r['plain_mismatches']})")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
