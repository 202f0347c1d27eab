"""TTFT of a request whose long prompt prefix is pulled from a peer worker vs recomputed, in one run.

    python -m benchmarks.prefix_pull_bench [--prefix-tokens 2000] [--reps 5]

Two workers of SmolLM2-135M (``start_worker_server``, both in this process, 1 torch thread each,
the shared-memory KV transport between them: they are on one host). Per repetition, with a prompt
prefix of ``--prefix-tokens`` random tokens new to both workers (so no earlier repetition helps):
    holder    the first worker runs prefix + question A (it now holds the prefix in its cache)
    recompute the second worker runs another new prefix + question B: it computes the whole prompt
    pull      the second worker runs the holder's prefix + question B with ``prefix_source`` naming
              the holder: it pulls the prefix's blocks and computes only the question
TTFT = Submit sent -> first token id received (gRPC, this process). The two measured requests have
the same length and alternate order across repetitions. Also checked: the pulled request's first
tokens equal the holder's recompute of the same prompt (the holder is asked last, from its cache).
Reported: median TTFT of each, pull / recompute ratio (target <= 0.5), the bytes pulled.

Noise: run it under the heavy-job lock (``flock /tmp/duet-heavy.lock ...``); the machine is shared,
so compare figures within one run. Writes JSON to ``--out`` (default
benchmarks/results/prefix_pull_bench.json).
"""

from __future__ import annotations

from typing import Any
import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import grpc
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "prefix_pull_bench.json"


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def ttft(server, rid: str, ids: list[int], source=None, max_tokens: int = 4) -> tuple[float | None, list[int]]:
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    request = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, prefix_source=source,
                                       sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          top_p=1, ignore_eos=True))
    async with grpc.aio.insecure_channel(server.endpoint) as channel:
        start, first, out = time.monotonic(), None, list[int]()
        async for msg in worker_pb2_grpc.WorkerStub(channel).Submit(request):
            if first is None and msg.token_ids:
                first = time.monotonic() - start
            out += msg.token_ids
    return first, out


async def load(server):
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    async with grpc.aio.insecure_channel(server.endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())


async def bench(args) -> dict:
    from protos.duet.worker.v1 import worker_pb2
    from workers.llm import engine_config
    from workers.server.service import start_worker_server

    config = engine_config(args.model, kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_batched_tokens=512)
    servers = [await start_worker_server(config, worker_id=f"w{i}", num_threads=1) for i in range(2)]
    holder, puller = servers
    bs = config.cache.block_size
    pulled_tokens = (args.prefix_tokens // bs) * bs
    rows = []
    try:
        for rep in range(args.reps):
            prefix, other = tokens(1000 + rep, args.prefix_tokens), tokens(2000 + rep, args.prefix_tokens)
            qa, qb = tokens(3000 + rep, 24), tokens(4000 + rep, 24)
            await ttft(holder, f"hold{rep}", prefix + qa, max_tokens=1)
            source = worker_pb2.PrefixSource(worker_id=holder.worker_id, endpoint=holder.endpoint,
                                             incarnation=holder.incarnation, num_tokens=pulled_tokens)
            runs = [("recompute", other + qb, None), ("pull", prefix + qb, source)]
            if rep % 2:
                runs.reverse()
            row: dict[str, Any] = {}
            for name, ids, src in runs:
                row[name], row[f"{name}_tokens"] = await ttft(puller, f"{name}{rep}", ids, src)
            _, reference = await ttft(holder, f"ref{rep}", prefix + qb)
            row["same_tokens"] = row["pull_tokens"] == reference
            rows.append(row)
            print(f"rep {rep}: recompute {row['recompute'] * 1e3:.0f} ms, pull {row['pull'] * 1e3:.0f} ms, "
                  f"same tokens {row['same_tokens']}")
        report = await load(puller)
    finally:
        for s in servers:
            await s.stop(grace=1)
    rec, pull = statistics.median(r["recompute"] for r in rows), statistics.median(r["pull"] for r in rows)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "model": args.model,
            "prefix_tokens": args.prefix_tokens, "pulled_tokens": pulled_tokens, "reps": rows,
            "ttft_recompute_median_s": rec, "ttft_pull_median_s": pull, "pull_vs_recompute": pull / rec,
            "all_same_tokens": all(r["same_tokens"] for r in rows),
            "puller": {"prefix_pulls": report.prefix_pulls, "prefix_pull_bytes": report.prefix_pull_bytes,
                       "prefix_pull_failures": report.prefix_pull_failures,
                       "kv_transfer_seconds": report.kv_transfer_seconds}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="prefix_pull_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kv-cache-mib", type=int, default=512, help="each worker's KV pool")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    out = asyncio.run(bench(args))
    print(f"TTFT median: recompute {out['ttft_recompute_median_s'] * 1e3:.0f} ms, pull "
          f"{out['ttft_pull_median_s'] * 1e3:.0f} ms -> {out['pull_vs_recompute']:.2f}x; same tokens: "
          f"{out['all_same_tokens']}; pulled {out['puller']['prefix_pull_bytes'] / max(out['puller']['prefix_pulls'], 1) / 1e6:.1f} "
          "MB per request")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
