"""Drafter pools: what sharing one drafter replica between targets buys, and what a remote draft
round costs (issue 31, benchmarks (a) and (b)). One run, both arms side by side, JSON out.

(a) draft tokens per CPU-second. T simulated targets (``--targets``, default 4), each with
    ``--requests`` greedy requests (1 and 4: one run each), draft rounds of k = ``--k`` tokens through the real proposer
    (workers/spec_decode/draft_model.py: one Rounds stream per (target, drafter) pair). Each target
    "verifies" by keeping ``--accept`` drafts and appending a token of its own, so every round rolls
    the drafter back and computes 1-2 tokens, as in decoding. Arms, alternated ``--repeats`` times:
      shared   ONE drafter replica (its own process, ``--shared-threads`` torch threads) serving all
               T targets: their rounds run as one continuous batch;
      private  T drafter replicas (one process each, ``--private-threads`` threads), one per target.
    The figure is draft tokens / CPU seconds (user + system) of the drafter processes over the
    measured rounds (each arm's processes started once, warmed up, then measured), so other tenants
    of a shared machine change wall time more than it. Same total CPUs: shared 4 threads vs 4 x 1
    (the issue's comparison), and shared 1 thread vs 4 x 1 (no oversubscription on a 2-core host).
(b) remote round overhead: one request, one drafter process on this host, rounds of k drafts
    alternating between an in-process DraftEngine (``propose``) and the same engine kind behind the
    Drafter service in another process (a DrafterLink round trip); overhead = median remote wall -
    median in-process wall, and the median of (remote wall - the drafter's own compute_seconds);
    also an empty round's round trip (the stream and the scheduler hand-off alone).

    python -m benchmarks.drafter_pool_bench                  # ~10 min on 2 loaded cores
    python -m benchmarks.drafter_pool_bench --repeats 1 --rounds 10   # smoke

Drafter processes use OMP_WAIT_POLICY=PASSIVE (both arms): spinning OpenMP threads would bill CPU
time for waiting on an oversubscribed host.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger("drafter_pool_bench")
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 96


# ------------------------------------------------------------------ the drafter process
def serve(model: str, quantization: str, threads: int) -> None:
    """``--serve``: a drafter replica in this process; prints its endpoint, serves until stdin closes."""
    import torch

    from workers.config import CacheConfig, EngineConfig
    from workers.spec_decode.drafter import DraftEngine
    from workers.spec_decode.drafter_service import serve_drafter

    torch.set_num_threads(threads)
    engine = DraftEngine(EngineConfig(model=model, quantization=quantization,
                                      cache=CacheConfig(kv_cache_memory_bytes=256 << 20)))
    server, endpoint = serve_drafter(engine)
    print(f"ENDPOINT {endpoint}", flush=True)
    sys.stdin.read()
    server.stop()


@dataclass
class Drafter:
    proc: subprocess.Popen
    endpoint: str

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def load(self) -> dict[str, float]:
        """The replica's engine counters (DrafterLoad): forward passes, rows, compute seconds."""
        import grpc

        from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc

        with grpc.insecure_channel(self.endpoint) as channel:
            load = drafter_pb2_grpc.DrafterStub(channel).GetLoad(drafter_pb2.GetDrafterLoadRequest(), timeout=30)
        return {k: float(getattr(load, k)) for k in ("forward_passes", "batched_rows", "compute_seconds", "rounds",
                                                     "draft_tokens")}

    def stop(self) -> None:
        assert self.proc.stdin is not None  # stdin=PIPE
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_drafter(model: str, quantization: str, threads: int) -> Drafter:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.drafter_pool_bench", "--serve", "--model", model,
                             "--quantization", quantization, "--threads", str(threads)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    if not line.startswith("ENDPOINT "):
        raise RuntimeError(f"drafter process did not start: {line!r}")
    return Drafter(proc, line.split()[1])


# ------------------------------------------------------------------ simulated targets
class Target:
    """A target's speculation loop without a target model: the real proposer and its stream; each
    step keeps ``accept`` drafts and appends a token of its own."""

    def __init__(self, name: str, drafter_endpoint: str, requests: int, k: int, accept: int, seed: int) -> None:
        from workers.engine.proposer import DrafterRef
        from workers.spec_decode.draft_model import DraftModelProposer

        self.proposer = DraftModelProposer(None, timeout_s=120.0, overlap=False, target=name)
        self.ref = DrafterRef(f"d@{drafter_endpoint}", drafter_endpoint)
        self.k, self.accept = k, accept
        self.contexts = {f"{name}-r{i}": [1000 + (seed * 131 + i * 17 + j * 7) % 20000 for j in range(PROMPT_LEN)]
                         for i in range(requests)}
        self.draft_tokens = 0

    def step(self) -> None:
        from workers.engine.proposer import DraftAsk
        from workers.sampling_params import SamplingParams

        greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
        asks = [DraftAsk(rid, ctx, self.k, greedy, self.ref) for rid, ctx in self.contexts.items()]
        drafts = self.proposer.propose(asks)
        for rid, ctx in self.contexts.items():
            d = drafts.get(rid)
            tokens = d.token_ids if d is not None else []
            self.draft_tokens += len(tokens)
            ctx.extend(tokens[: self.accept])
            ctx.append(2000 + len(ctx) % 5000)  # the target's own token

    def close(self) -> None:
        for rid in self.contexts:
            self.proposer.release(rid)
        self.proposer.close()


def run_arm(drafters: list[Drafter], targets: int, requests: int, k: int, accept: int, rounds: int,
            warmup: int, seed: int) -> dict[str, Any]:
    """T targets (target i on drafters[i % len]) stepping concurrently; -> tokens, CPU s, wall s."""
    ts = [Target(f"t{seed}-{i}", drafters[i % len(drafters)].endpoint, requests, k, accept, seed * 10 + i)
          for i in range(targets)]

    def loop(t: Target, n: int) -> None:
        for _ in range(n):
            t.step()

    def all_steps(n: int) -> None:
        threads = [threading.Thread(target=loop, args=(t, n)) for t in ts]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    all_steps(warmup)  # prompts computed, links open
    tokens0 = sum(t.draft_tokens for t in ts)
    loads0 = [d.load() for d in drafters]
    cpu0 = sum(d.cpu_seconds() for d in drafters)
    load0 = psutil.cpu_times()
    t0 = time.perf_counter()
    all_steps(rounds)
    wall = time.perf_counter() - t0
    cpu = sum(d.cpu_seconds() for d in drafters) - cpu0
    engine = {k: sum(d.load()[k] - l0[k] for d, l0 in zip(drafters, loads0)) for k in loads0[0]}
    tokens = sum(t.draft_tokens for t in ts) - tokens0
    load1 = psutil.cpu_times()
    for t in ts:
        t.close()
    busy = (load1.user + load1.system + load1.nice) - (load0.user + load0.system + load0.nice)
    return {"draft_tokens": tokens, "cpu_seconds": cpu, "wall_seconds": wall, "tokens_per_cpu_second": tokens / cpu,
            "tokens_per_second": tokens / wall, "host_cpu_seconds_busy": busy,
            # where the drafter processes' CPU went: rows per forward pass (the batching the arm got) and
            # the engine's own compute (scheduler-thread wall time in forward passes) vs their CPU seconds
            "rows_per_pass": engine["batched_rows"] / max(engine["forward_passes"], 1),
            "passes_per_round": engine["forward_passes"] / max(engine["rounds"], 1),
            "engine_compute_seconds": engine["compute_seconds"], "engine_forward_passes": engine["forward_passes"]}


def bench_sharing(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shared_threads in args.shared_threads:
        shared = [start_drafter(args.model, args.quantization, shared_threads)]
        private = [start_drafter(args.model, args.quantization, args.private_threads) for _ in range(args.targets)]
        try:
            for requests in args.requests:
                key = f"shared_{shared_threads}t_vs_{args.targets}x{args.private_threads}t_{requests}req"
                runs: dict[str, list[dict]] = {"shared": [], "private": []}
                for rep in range(args.repeats):  # alternate the arms: drift in the machine's load hits both
                    for arm, drafters in (("shared", shared), ("private", private)):
                        r = run_arm(drafters, args.targets, requests, args.k, args.accept, args.rounds, args.warmup,
                                    seed=1000 * requests + rep * 2 + (arm == "private"))
                        logger.info("%s %s rep %d: %.1f draft tokens / CPU s (%.1f tokens/s wall; %.1f rows a pass, "
                                    "%.1f passes a round, engine compute %.1f s of %.1f CPU s)", key, arm, rep,
                                    r["tokens_per_cpu_second"], r["tokens_per_second"], r["rows_per_pass"],
                                    r["passes_per_round"], r["engine_compute_seconds"], r["cpu_seconds"])
                        runs[arm].append(r)
                med = {arm: statistics.median(r["tokens_per_cpu_second"] for r in rs) for arm, rs in runs.items()}
                wall = {arm: statistics.median(r["tokens_per_second"] for r in rs) for arm, rs in runs.items()}
                out[key] = {"shared_threads": shared_threads, "requests_per_target": requests, "runs": runs,
                            "median_tokens_per_cpu_second": med, "median_tokens_per_second": wall,
                            "ratio_per_cpu_second": med["shared"] / med["private"],
                            "ratio_per_second": wall["shared"] / wall["private"]}
        finally:
            for d in shared + private:
                d.stop()
    return out


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from protos.duet.drafter.v1 import drafter_pb2
    from workers.config import CacheConfig, EngineConfig
    from workers.sampling_params import SamplingParams
    from workers.spec_decode.drafter import DraftEngine, DraftItem
    from workers.spec_decode.drafter_link import DrafterLink

    torch.set_num_threads(1)
    local = DraftEngine(EngineConfig(model=args.model, quantization=args.quantization,
                                     cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
    remote = start_drafter(args.model, args.quantization, 1)
    link = DrafterLink(remote.endpoint, target="overhead")
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    sampling = drafter_pb2.Sampling(temperature=0.0)
    ctx = [1000 + (j * 7) % 20000 for j in range(PROMPT_LEN)]
    [res] = local.propose([DraftItem("l", 0, ctx, args.k, greedy)])
    first = link.send([drafter_pb2.DraftItem(request_id="r", full_context=True, new_token_ids=ctx, num_tokens=args.k,
                                             sampling=sampling)]).result(timeout=120)
    # what each drafter holds: the confirmed context + its drafts (the round's diff is against it)
    local_held, local_drafts = ctx + res.token_ids, len(res.token_ids)
    remote_held, remote_drafts = ctx + list(first.drafts[0].token_ids), len(first.drafts[0].token_ids)
    inproc, wall, beyond, empty = [], [], [], []
    try:
        for i in range(args.overhead_rounds):
            t0 = time.perf_counter()
            link.send([]).result(timeout=120)  # an empty round: the stream and the scheduler hand-off alone
            empty.append(time.perf_counter() - t0)
            # a round as in decoding: the target kept 2 drafts and appended its own token; draft k more
            tok = 3000 + i % 5000
            keep = len(local_held) - local_drafts + min(2, local_drafts)
            t0 = time.perf_counter()
            [res] = local.propose([DraftItem("l", keep, [tok], args.k, greedy, held_len=len(local_held))])
            inproc.append(time.perf_counter() - t0)
            local_held, local_drafts = local_held[:keep] + [tok] + res.token_ids, len(res.token_ids)
            keep = len(remote_held) - remote_drafts + min(2, remote_drafts)
            item = drafter_pb2.DraftItem(request_id="r", keep=keep, held_len=len(remote_held), new_token_ids=[tok],
                                         num_tokens=args.k, sampling=sampling)
            t0 = time.perf_counter()
            resp = link.send([item]).result(timeout=120)
            dt = time.perf_counter() - t0
            wall.append(dt)
            beyond.append(dt - resp.compute_seconds)
            assert not resp.drafts[0].resync, "the remote drafter lost track of the diff"
            drafts = list(resp.drafts[0].token_ids)
            remote_held, remote_drafts = remote_held[:keep] + [tok] + drafts, len(drafts)
    finally:
        link.close()
        remote.stop()
    return {"rounds": len(wall), "k": args.k, "median_in_process_s": statistics.median(inproc),
            "median_remote_s": statistics.median(wall), "median_remote_beyond_compute_s": statistics.median(beyond),
            "overhead_median_s": statistics.median(wall) - statistics.median(inproc),
            "median_empty_round_s": statistics.median(empty), "target_s": 1e-3,
            "in_process_s": inproc, "remote_s": wall, "remote_beyond_compute_s": beyond, "empty_round_s": empty}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--targets", type=int, default=4)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 4], help="requests per target (one run each)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--accept", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12, help="measured rounds per target per repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shared-threads", type=int, nargs="+", default=[4, 1])
    p.add_argument("--private-threads", type=int, default=1)
    p.add_argument("--overhead-rounds", type=int, default=200)
    p.add_argument("--skip", nargs="+", default=[], choices=["overhead", "sharing"], help="parts not to run")
    p.add_argument("--out", type=Path, default=RESULTS / "drafter_pool_bench.json")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.model, args.quantization, args.threads)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from benchmarks.engine_throughput import code_version, machine_info
    from workers.models.assets.resolve import resolve_model

    args.model = str(resolve_model(args.model))
    started = time.strftime("%Y-%m-%d %H:%M")
    load_before = os.getloadavg()
    result: dict[str, Any] = {"benchmark": "drafter_pool_bench", "date": started, "machine": machine_info(), "code": code_version(),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "loadavg_before": load_before}
    if "overhead" not in args.skip:
        result["overhead"] = bench_overhead(args)
        logger.info("remote round overhead: %.3f ms median (in-process %.2f ms, remote %.2f ms)",
                    result["overhead"]["overhead_median_s"] * 1e3, result["overhead"]["median_in_process_s"] * 1e3,
                    result["overhead"]["median_remote_s"] * 1e3)
    if "sharing" not in args.skip:
        result["sharing"] = bench_sharing(args)
    result["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for key, r in result.get("sharing", {}).items():
        print(f"{key}: shared {r['median_tokens_per_cpu_second']['shared']:.1f} vs private "
              f"{r['median_tokens_per_cpu_second']['private']:.1f} draft tokens / CPU s: "
              f"{r['ratio_per_cpu_second']:.2f}x (wall {r['ratio_per_second']:.2f}x)")
    if "overhead" not in result:
        return
    o = result["overhead"]
    print(f"remote round overhead (median): {o['overhead_median_s'] * 1e3:.3f} ms "
          f"(in-process {o['median_in_process_s'] * 1e3:.2f} ms, remote {o['median_remote_s'] * 1e3:.2f} ms, "
          f"beyond the drafter's compute {o['median_remote_beyond_compute_s'] * 1e3:.3f} ms, an empty round "
          f"{o['median_empty_round_s'] * 1e3:.3f} ms); load {load_before}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
