"""Several routers active-active on the same workers: load imbalance, prefix-hit rate, throughput and
TTFT with 1, 2 and 3 routers, side by side in one run.

    python -m benchmarks.routers_bench [--workers 4] [--streams 24] [--seconds 6] [--routers 1 2 3] [--phases ...]

Setup, all in this process: ``--workers`` echo workers (cluster/bench/echo_worker.py: no model work,
``--first-token-ms`` then one id every ``--gap-ms``; an honest load report -- running requests,
outstanding tokens -- and a stand-in prefix cache that reports block events like a real worker's),
and for each router count N, N routers (``serve_router``, each on its own thread and event loop,
default poll interval) with the same member list. ``--streams`` closed-loop clients, client i
always sending to router i mod N, run for ``--seconds`` per phase:

    least_loaded  random 64-token prompts, policy least_loaded: how evenly N routers that each see
                  the workers' reports (and only their own sends since the last report) fill them
    prefix_aware  ``--prefixes`` shared 256-token prefixes (16 blocks) + a random 16-token suffix,
                  policy prefix_aware (reported holdings + own sends of the last second), the
                  holdings pushed by the workers as they change (router/block_watch.py: the default)
    prefix_aware_poll  the same with ``watch_block_events`` off: holdings from the load poll only
                  (every 0.2 s), the baseline of the push
    prefix_aware_random  random 64-token prompts, policy prefix_aware: every prompt is new, so this
                  is how evenly its no-match path (router/policies/cold_home.py) fills the workers
    prefix_aware_random_poll  the same with ``watch_block_events`` off (the baseline)
    *_home        the same with prefix_aware's ``cold_home`` on (a prompt no worker holds goes to
                  its home, the same worker from every router) against the default (to the
                  least-loaded worker as this router sees it), side by side in the same run

Reported per phase and N (medians over samples every 20 ms of each worker's running requests):
    imbalance_max_over_mean   max over workers / mean over workers of running requests (1.0 = even)
    imbalance_spread          max - min running requests
    peak_running              the most requests one worker ran at once (the ideal is streams / workers)
    prefix_hit_rate           prompt blocks found in the routed worker's cache / blocks looked up
    throughput_rps, ttft_p50_ms, ttft_p99_ms   completed requests per second; send -> first token

One process: the routers share the GIL with each other, the echo workers and the clients, so this
measures routing quality (imbalance, hits), not how throughput scales with routers (that needs a
process or pod per router). Compare N against N = 1 within one run; the machine is shared.
Writes JSON to ``--out`` (default benchmarks/results/routers_bench.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from cluster.bench.echo_worker import EchoWorker, start_echo_worker
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig
from router.server import serve_router

DEFAULT_MODEL = Path.home() / ".cache" / "duet" / "models" / "SmolLM2-135M-Instruct"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


# phase -> (policy, its options, RouterConfig overrides). The *_home phases run prefix_aware with
# cold_home on (a prompt no worker holds goes to its home, router/policies/cold_home.py); the phase
# without is its baseline. prefix_aware_poll: block events from the load poll only (no WatchBlocks).
PHASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "least_loaded": ("least_loaded", {}, {}),
    "prefix_aware": ("prefix_aware", {}, {}), "prefix_aware_home": ("prefix_aware", {"cold_home": True}, {}),
    "prefix_aware_poll": ("prefix_aware", {}, {"watch_block_events": False}),
    "prefix_aware_random": ("prefix_aware", {}, {}),
    "prefix_aware_random_poll": ("prefix_aware", {}, {"watch_block_events": False}),
    "prefix_aware_random_home": ("prefix_aware", {"cold_home": True}, {})}
SHARED_PREFIX_PHASES = ("prefix_aware", "prefix_aware_home", "prefix_aware_poll")


def _prompt(rng: random.Random, phase: str, prefixes: list[list[int]]) -> list[int]:
    if phase in SHARED_PREFIX_PHASES:
        return rng.choice(prefixes) + [rng.randrange(1000, 20000) for _ in range(16)]
    return [rng.randrange(1000, 20000) for _ in range(64)]


async def _client(i: int, address: str, phase: str, prefixes: list[list[int]], max_tokens: int, stop_at: float,
                  ttfts: list[float], done: list[int]) -> None:
    rng = random.Random(i)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = duet_pb2_grpc.DuetStub(channel)
        while time.monotonic() < stop_at:
            req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=_prompt(rng, phase, prefixes)),
                                           sampling=duet_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            sent, first = time.monotonic(), None
            async for _ in stub.Generate(req, timeout=60):
                if first is None:
                    first = time.monotonic()
                    ttfts.append(first - sent)
            done[0] += 1


async def _sample(workers: list[EchoWorker], stop_at: float, samples: list[list[int]]) -> None:
    while time.monotonic() < stop_at:
        samples.append([w.running for w in workers])
        await asyncio.sleep(0.02)


def run_phase(args: argparse.Namespace, n_routers: int, phase: str, members: list[tuple[str, str]],
              workers: list[EchoWorker], prefixes: list[list[int]]) -> dict[str, Any]:
    policy, options, overrides = PHASES[phase]
    routers = [serve_router(RouterConfig(tokenizer_path=str(args.model_path), port=0, http_port=0, policy=policy,
                                         policy_options=options, max_in_flight=1024, **overrides), members)
               for _ in range(n_routers)]
    q0, h0 = sum(w.prefix_queries for w in workers), sum(w.prefix_hits for w in workers)
    try:
        time.sleep(0.5)  # a few polls: every router has every worker's first report
        ttfts: list[float] = []
        done = [0]
        samples: list[list[int]] = []

        async def drive() -> None:
            start = time.monotonic()
            stop_at = start + args.seconds
            await asyncio.gather(_sample(workers, stop_at, samples), *(
                _client(i, routers[i % n_routers].address, phase, prefixes, args.max_tokens, stop_at, ttfts, done)
                for i in range(args.streams)))

        started = time.monotonic()
        asyncio.run(drive())
        elapsed = time.monotonic() - started
    finally:
        for r in routers:
            r.stop(0)
    steady = [s for s in samples[len(samples) // 5:] if sum(s)]  # skip the ramp-up fifth
    queries = sum(w.prefix_queries for w in workers) - q0
    hits = sum(w.prefix_hits for w in workers) - h0
    return {
        "routers": n_routers, "phase": phase, "requests": done[0], "seconds": round(elapsed, 2),
        "throughput_rps": round(done[0] / elapsed, 1),
        "ttft_p50_ms": round(1e3 * _quantile(ttfts, 0.5), 2), "ttft_p99_ms": round(1e3 * _quantile(ttfts, 0.99), 2),
        "imbalance_max_over_mean": round(statistics.median(max(s) / (sum(s) / len(s)) for s in steady), 3)
        if steady else None,
        "imbalance_max_over_mean_p95": round(_quantile([max(s) / (sum(s) / len(s)) for s in steady], 0.95), 3)
        if steady else None,
        "imbalance_spread": statistics.median(max(s) - min(s) for s in steady) if steady else None,
        "peak_running": max((max(s) for s in steady), default=0),
        "ideal_running": round(args.streams / len(workers), 2),
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
    }


def _summary(results: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (phase, N): medians over the repeats (the hit-rate difference is paired within a repeat)."""
    out = []
    for phase in args.phases:
        for n in args.routers:
            rows = [r for r in results if r["phase"] == phase and r["routers"] == n]
            row: dict[str, Any] = {"phase": phase, "routers": n, "repeats": len(rows)}
            for key in ("prefix_hit_rate", "prefix_hit_points_vs_1", "imbalance_max_over_mean",
                        "imbalance_max_over_mean_p95", "peak_running", "throughput_rps", "ttft_p50_ms"):
                xs = [r[key] for r in rows if r.get(key) is not None]
                row[f"median_{key}"] = round(statistics.median(xs), 4) if xs else None
                if key == "prefix_hit_points_vs_1" and xs:
                    row["points_vs_1_all"] = xs
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--streams", type=int, default=24)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--routers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--phases", nargs="+", choices=sorted(PHASES), default=list(PHASES))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--first-token-ms", type=float, default=20.0)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="tokenizer directory")
    p.add_argument("--repeats", type=int, default=1, help="run every (phase, N) point this many times, "
                   "interleaved; the summary gives medians over the repeats")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/routers_bench.json"))
    args = p.parse_args(argv)
    loop = _Loop()
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(256)] for _ in range(args.prefixes)]
    results = []
    for repeat, phase, n in ((r, ph, n) for r in range(args.repeats) for ph in args.phases for n in args.routers):
        # fresh workers per point: empty caches, so every N starts from the same state
        workers = [EchoWorker(args.first_token_ms, args.gap_ms) for _ in range(args.workers)]
        servers = [loop.run(start_echo_worker(worker=w)) for w in workers]
        members = [(f"e{i}", f"127.0.0.1:{port}") for i, (_, port) in enumerate(servers)]
        try:
            row = run_phase(args, n, phase, members, workers, prefixes)
        finally:
            for server, _ in servers:
                loop.run(server.stop(0))
        row["repeat"] = repeat
        print(json.dumps(row), flush=True)
        results.append(row)
    base = {(r["repeat"], r["phase"]): r for r in results if r["routers"] == min(args.routers)}
    for r in results:
        b = base[r["repeat"], r["phase"]]
        r["throughput_vs_1"] = round(r["throughput_rps"] / b["throughput_rps"], 3) if b["throughput_rps"] else None
        if r["prefix_hit_rate"] is not None and b["prefix_hit_rate"] is not None:
            r["prefix_hit_points_vs_1"] = round(100 * (r["prefix_hit_rate"] - b["prefix_hit_rate"]), 2)
    summary = _summary(results, args)
    for row in summary:
        print(json.dumps(row), flush=True)
    report = {"benchmark": "routers_bench", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
              "summary": summary, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
