"""Routing on KV tiers vs routing blind to them, side by side in one run: multi-turn conversations
through a router in front of two workers whose device caches cannot hold the history.

    python -m benchmarks.tier_routing_bench [--convs 8] [--turns 4] [--history 160] [--user 32]

Two deployments, each a router (``prefix_aware``, in this process) in front of two SmolLM2-135M
workers (``start_worker_server``, in this process, 1 torch thread each) with a 16 MiB device cache
(``--device-mib``; 728 tokens with bf16 KV, 364 with fp32) and a 256 MiB host tier:
    aware   the default weights: a block the worker holds in host counts 0.9, on disk 0.5
    blind   host_weight = disk_weight = 0: a block that left the device counts nothing, as before
            the block events carried the tier (the router then sees only device holdings)
Workload: ``--convs`` conversations, each with its own ``--history`` random tokens, ``--turns``
turns of ``--user`` new tokens and 8 greedy output tokens (ignore_eos); round by round, two
conversations at a time (so the workers are both busy and least-loaded spreads the blind router's
misses). Each pair is sent to both deployments back to back, the order alternating, so load drift
on the shared machine hits them alike. The conversations' histories outgrow the device caches, so a
later turn finds its history in the host tier of the worker that ran the earlier turns, if the
router sends it there.

Reported per deployment: TTFT p50/p99 over all turns and over turns 2+ (the ones that can hit), hit
rate per tier over the prompt blocks (cluster/bench/tier_hits.py, summed over both workers),
the router's matched blocks per tier, and whether both deployments produced the same tokens.
Writes JSON to ``--out`` (default benchmarks/results/tier_routing_bench.json). Run it under the
heavy-job lock (``flock /tmp/duet-heavy.lock ...``); compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "tier_routing_bench.json"
CONFIGS = {"aware": {}, "blind": {"host_weight": 0.0, "disk_weight": 0.0}}


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def generate(address: str, ids: list[int]) -> tuple[float, list[int]]:
    from protos.duet.v1 import duet_pb2, duet_pb2_grpc

    req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=ids), sampling=duet_pb2.SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        start, first, out = time.perf_counter(), None, []
        for r in duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=600):
            if first is None and r.token_ids:
                first = time.perf_counter() - start
            out += r.token_ids
    assert first is not None
    return first, out


def counters(endpoints: list[str]) -> list[Any]:
    from cluster.bench.tier_hits import HitCounters
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    out = []
    for e in endpoints:
        with grpc.insecure_channel(e) as channel:
            out.append(HitCounters.from_report(worker_pb2_grpc.WorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=10)))
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from cluster.bench.tier_hits import HitCounters, hit_rates
    from router.config import RouterConfig
    from router.server import serve_router
    from workers.config import CacheConfig, EngineConfig
    from workers.models.assets.resolve import resolve_model
    from workers.server.service import start_worker_server
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model))
    config = EngineConfig(model=str(model), cache=CacheConfig(kv_cache_memory_bytes=args.device_mib << 20,
                                                              host_tier_bytes=args.host_mib << 20))
    lt = LoopThread()
    deployments: dict[str, dict[str, Any]] = {}
    try:
        for name, opts in CONFIGS.items():
            workers = [lt.run(start_worker_server(config, worker_id=f"{name}-w{i}", num_threads=1)) for i in range(2)]
            router = serve_router(RouterConfig(tokenizer_path=str(model), port=0, http_port=0, policy="prefix_aware",
                                               policy_options=opts, load_poll_interval_s=0.05),
                                  [(w.worker_id, w.endpoint) for w in workers], tokenizer=tok)
            deployments[name] = {"workers": workers, "router": router, "ttft": [], "ttft_later": [], "outs": {},
                                 "prompt_lengths": [], "c0": counters([w.endpoint for w in workers])}
        hist = {c: tokens(1000 + c, args.history) for c in range(args.convs)}
        order = list(CONFIGS)
        for t in range(args.turns):
            for c0 in range(0, args.convs, 2):
                pair = [c for c in (c0, c0 + 1) if c < args.convs]
                prompts = {c: hist[c] + tokens(10_000 * (t + 1) + c, args.user) for c in pair}
                order.reverse()
                for name in order:
                    d = deployments[name]
                    with concurrent.futures.ThreadPoolExecutor(len(pair)) as pool:
                        futures = {c: pool.submit(generate, d["router"].address, prompts[c]) for c in pair}
                    for c in pair:
                        first, out = futures[c].result()
                        d["ttft"].append(first)
                        if t > 0:
                            d["ttft_later"].append(first)
                        d["outs"][(c, t)] = out
                        d["prompt_lengths"].append(len(prompts[c]))
                    time.sleep(0.15)  # a few load polls: the routers see the new holdings
                ref = deployments[order[0]]["outs"]
                for c in pair:  # the next turn continues the aware deployment's answer (both are checked equal)
                    hist[c] = prompts[c] + ref[(c, t)]
        res: dict[str, Any] = {}
        for name, d in deployments.items():
            c1 = counters([w.endpoint for w in d["workers"]])
            total0 = HitCounters(c1[0].block_size, *(sum(getattr(x, f) for x in d["c0"])
                                                     for f in ("device", "host", "disk_read_back")))
            total1 = HitCounters(c1[0].block_size, *(sum(getattr(x, f) for x in c1)
                                                     for f in ("device", "host", "disk_read_back")))
            q, later = sorted(d["ttft"]), sorted(d["ttft_later"])
            policy = d["router"].server.pipeline.policy.counters()
            res[name] = {
                "requests": len(q), "ttft_p50_ms": statistics.median(q) * 1e3,
                "ttft_p99_ms": q[min(len(q) - 1, int(0.99 * len(q)))] * 1e3,
                "later_turns_ttft_p50_ms": statistics.median(later) * 1e3 if later else None,
                "hit_rate": hit_rates(total0, total1, d["prompt_lengths"]),
                "router": {k: policy[k] for k in ("prefix_hits", "no_match", "imbalance_fallbacks",
                                                  "matched_device_blocks", "matched_host_blocks",
                                                  "matched_disk_blocks")},
            }
        res["tokens_equal"] = deployments["aware"]["outs"] == deployments["blind"]["outs"]
        res["later_turns_ttft_ratio_aware_vs_blind"] = (res["aware"]["later_turns_ttft_p50_ms"]
                                                       / res["blind"]["later_turns_ttft_p50_ms"])
        return res
    finally:
        for d in deployments.values():
            d["router"].stop(0)
            for w in d["workers"]:
                lt.run(w.stop(grace=1))
        lt.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history", type=int, default=240, help="tokens of each conversation's own opening")
    p.add_argument("--user", type=int, default=32, help="new tokens per turn")
    p.add_argument("--device-mib", type=int, default=16)
    p.add_argument("--host-mib", type=int, default=256)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    t0 = time.time()
    load0 = os.getloadavg()
    res = bench(args)
    res.update(config=vars(args) | {"out": str(args.out)}, machine={"cpus": os.cpu_count(), "python": platform.python_version()},
               load_avg_start=load0, load_avg_end=os.getloadavg(), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
               wall_s=time.time() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    for name in CONFIGS:
        r = res[name]
        print(f"{name:>6}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  turns 2+ p50 "
              f"{r['later_turns_ttft_p50_ms']:7.1f} ms  hits device {r['hit_rate']['device']:.2f} host "
              f"{r['hit_rate']['host']:.2f}  router {r['router']}")
    print(f"turns 2+ TTFT p50 aware / blind: {res['later_turns_ttft_ratio_aware_vs_blind']:.2f}; tokens equal: "
          f"{res['tokens_equal']}; load {load0[0]:.1f} -> {res['load_avg_end'][0]:.1f}; {res['wall_s']:.0f} s")
    return res


if __name__ == "__main__":
    main()
