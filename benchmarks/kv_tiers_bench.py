"""KV tiers side by side, engine level, in one run: tiers off vs host tier vs host + disk tier.

    python -m benchmarks.kv_tiers_bench [--convs 8] [--turns 4] [--user-tokens 96] [--out PATH]

One process, SmolLM2-135M on CPU (``--threads`` torch threads), a device KV cache of
``--device-blocks`` blocks of 16 tokens: less than the workload's history, so with tiers off a
conversation's earlier turns have been evicted (and are recomputed) by the time its next turn comes.

Workloads (random token ids, greedy, ``ignore_eos``, ``--gen-tokens`` out per request, one request
at a time so TTFT is not queueing):
    multiturn  ``--convs`` conversations x ``--turns`` turns, round robin; each turn's prompt is the
               conversation so far (system ``--system-tokens`` + per turn ``--user-tokens`` + the
               answers) - more history than the device cache
    nohit      the same number of requests with prompts of the same lengths that share nothing: what
               the tiers cost when they never hit (every eviction still copies a block down)
Configs: off (no tiers), auto (the default, ``host_tier_bytes: auto``: a host tier the device
cache's size, workers/kv/tiers/budget.py), host (``--host-mib``, room for everything), host+disk (host of
``--small-host-mib``, disk ``--disk-mib`` in a temp directory), and with ``--node``, node (the host
tier of ``--host-mib`` in the node's shared memory, ``cache.host_tier_shared``: workers/kv/tiers/node.py;
one engine here, so it measures what files in /dev/shm cost against an in-process host tier).

The configs run side by side, interleaved: each request runs on every config back to back
(rotating which goes first), so load drift on a shared machine hits them alike.

Reported per (workload, config): TTFT p50 / p99 (add -> the step that returns the first token),
throughput (prompt + output tokens of all requests / the config's own busy time), the paired request
time vs off (median and quartiles over requests of this config's time for request i / off's: each
pair ran back to back, so load drift and a stall on one request do not move it), hit rate per tier
(device prefix hits, host loads, disk reads over prompt blocks), and whether every config's tokens
equal tiers off.
Ratios vs off in the same run. Writes JSON to ``--out`` (default benchmarks/results/kv_tiers_bench.json).
The machine is shared: note ``uptime`` with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "kv_tiers_bench.json"


def rand_tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def multiturn_prompts(args) -> list[tuple[int, list[int]]]:
    """(conversation, user tokens) in arrival order; the engine run appends history."""
    return [(c, rand_tokens(1000 * t + c, args.user_tokens)) for t in range(args.turns) for c in range(args.convs)]


class Lane:
    """One config's engine and its share of the run (its own conversations' history and timings)."""

    def __init__(self, llm, args) -> None:
        self.llm, self.engine = llm, llm.engine
        self.hist = {c: rand_tokens(7 + c, args.system_tokens) for c in range(args.convs)}
        self.ttfts: list[float] = []
        self.outs: list[list[int]] = []
        self.busy_s = 0.0
        self.request_s: list[float] = []  # each request's busy time, in arrival order (paired across configs)
        self.n_tokens = self.n_prompt_blocks = 0
        self.s0 = self.engine.stats()

    def request(self, i: int, c: int, user: list[int], workload: str, params) -> None:
        engine = self.engine
        if workload == "multiturn":
            prompt = self.hist[c] + user
        else:  # same length, nothing shared
            prompt = rand_tokens(10_000_000 + i, len(self.hist[c]) + len(user))
        t0 = time.perf_counter()
        rid = engine.add_request(f"r{i}", prompt, params)
        first, got = None, []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    got += o.new_token_ids
                    if first is None and o.new_token_ids:
                        first = time.perf_counter() - t0
        self.request_s.append(time.perf_counter() - t0)
        self.busy_s += self.request_s[-1]
        assert first is not None, f"request r{i} produced no token"
        self.ttfts.append(first)
        self.outs.append(got)
        self.hist[c] = prompt + got if workload == "multiturn" else self.hist[c] + user + got
        self.n_tokens += len(prompt) + len(got)
        self.n_prompt_blocks += (len(prompt) - 1) // engine.block_manager.block_size

    def result(self) -> dict:
        s1 = self.engine.stats()
        t1s, t0s = s1.tiers, self.s0.tiers
        host = (t1s.host_hits - t0s.host_hits) if t1s else 0
        disk = (t1s.disk_hits - t0s.disk_hits) if t1s else 0
        device = s1.blocks.prefix_cache_hits - self.s0.blocks.prefix_cache_hits
        q = sorted(self.ttfts)
        nb = self.n_prompt_blocks
        return {
            "requests": len(q), "ttft_p50_s": statistics.median(q), "ttft_p99_s": q[min(len(q) - 1, int(0.99 * len(q)))],
            "throughput_tok_s": self.n_tokens / self.busy_s, "busy_s": self.busy_s, "prompt_blocks": nb,
            "hit_rate": {"device": device / nb, "host": host / nb, "disk_read_back": disk / nb},
            "tiers": None if t1s is None else dict(t1s.__dict__),
            "tokens": self.outs, "request_s": self.request_s,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--gen-tokens", type=int, default=8)
    ap.add_argument("--device-blocks", type=int, default=48)
    ap.add_argument("--host-mib", type=int, default=512)
    ap.add_argument("--small-host-mib", type=int, default=16)
    ap.add_argument("--disk-mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--node", action="store_true", help="add the node config (host tier in /dev/shm)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workers.llm import LLM
    from workers.models.assets.resolve import resolve_model

    path = str(resolve_model("SmolLM2-135M-Instruct"))
    device = dict(num_blocks=args.device_blocks, block_size=16, max_num_batched_tokens=512, max_num_seqs=8)
    configs = {
        "off": dict(host_tier_bytes=0),
        "auto": {},  # the default (host_tier_bytes 'auto'): a host tier the device cache's size
        "host": dict(host_tier_bytes=args.host_mib << 20),
        "host+disk": dict(host_tier_bytes=args.small_host_mib << 20, disk_tier_bytes=args.disk_mib << 20,
                          tier_load_timeout_s=5.0),
    }
    if args.node:
        configs["node"] = dict(host_tier_bytes=args.host_mib << 20, host_tier_shared=True)
    from workers.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="duet-kv-bench-") as tmp:
        for workload in ("multiturn", "nohit"):
            lanes = {}
            for name, extra in configs.items():
                if "disk_tier_bytes" in extra:
                    extra = {**extra, "disk_tier_dir": tmp}
                llm = LLM(path, **device, **extra)
                llm.engine.warm_up()
                lanes[name] = Lane(llm, args)
            # interleaved: request i runs on every config back to back (order rotating), so load
            # drift on a shared machine hits each config alike
            names = list(lanes)
            for i, (c, user) in enumerate(multiturn_prompts(args)):
                for k in range(len(names)):
                    lanes[names[(i + k) % len(names)]].request(i, c, user, workload, params)
            results[workload] = {name: lane.result() for name, lane in lanes.items()}
            for lane in lanes.values():
                lane.engine.close()
            off = results[workload]["off"]
            for name, r in results[workload].items():
                print(f"{workload:9s} {name:9s} ttft p50 {r['ttft_p50_s'] * 1e3:7.1f} ms  p99 "
                      f"{r['ttft_p99_s'] * 1e3:7.1f} ms  {r['throughput_tok_s']:7.0f} tok/s  hits "
                      + " ".join(f"{k} {v:.2f}" for k, v in r["hit_rate"].items()), flush=True)
                r["identical_to_off"] = r["tokens"] == off["tokens"]
                r["ttft_p50_vs_off"] = r["ttft_p50_s"] / off["ttft_p50_s"]
                r["throughput_vs_off"] = r["throughput_tok_s"] / off["throughput_tok_s"]
                # paired: request i ran on every config back to back, so its time ratio is immune to
                # the load drifting between requests; a stall hits one pair, not the median
                q = sorted(a / b for a, b in zip(r["request_s"], off["request_s"]))
                r["paired_time_vs_off"] = {"p25": q[len(q) // 4], "median": statistics.median(q),
                                           "p75": q[(3 * len(q)) // 4]}
            for r in results[workload].values():
                del r["tokens"]
        left = os.listdir(tmp) + [p.name for p in Path("/dev/shm").glob("duet-kv-node-*")]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": os.getloadavg(),
        "cpu": platform.processor() or platform.machine(), "threads": args.threads, "args": vars(args) | {"out": str(args.out)},
        "results": results, "disk_files_left": left,
    }
    for workload, rs in results.items():
        for name, r in rs.items():
            pt = r["paired_time_vs_off"]
            print(f"{workload:9s} {name:9s} ttft p50 x{r['ttft_p50_vs_off']:.2f}  throughput x{r['throughput_vs_off']:.2f}"
                  f"  request time x{pt['median']:.2f} (p25 {pt['p25']:.2f}, p75 {pt['p75']:.2f})"
                  f"  identical {r['identical_to_off']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
