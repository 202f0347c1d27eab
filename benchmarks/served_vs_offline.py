"""Served vs offline: `duet serve` under N concurrent streaming requests against the offline engine at
the same batch, same prompts, same settings.

    .venv/bin/python benchmarks/served_vs_offline.py [--quick] [--quant q4] [--cpus 1]
        [--concurrency 1,8,32,64] [--requests-per-stream 3] [--temperature 1.0] [--out PATH]
        [--server-cores 0 --client-cores 1]   # as make bench-peers runs: the client on a core of its own
        [--worker-only-pin]   # with those: only the worker on core 0 (as the offline engine), router + Ray on 1
        [--per-request-streams]   # the router's plain transport (a Submit call per request), to compare

Workload (the issue's AIPerf setup): every request has a --prompt-tokens prompt of distinct token
ids (no prefix-cache hits) and makes exactly --output-tokens tokens (ignore_eos), at
--temperature (1.0: what the router uses when a client sends none, as AIPerf does). Closed loop at
concurrency N: each of N streams sends its next request when the previous one ends,
--requests-per-stream times (after one warm-up round).

    offline  a child process (the worker's settings: --cpus torch threads, the environment a pool's
             worker starts with, workers/server/threads.py process_env) drives ``Engine`` directly:
             N requests in flight, a finished one replaced at once. Output tokens / wall time; ITL = a request's gap between tokens.
    served   ``duet serve`` (a child process: embedded Ray with --cpus + 1 CPUs, one worker with
             --cpus CPUs, the router's OpenAI HTTP API) and this process as the client: N
             concurrent POST /v1/completions with stream=true and prompt token ids. Output tokens /
             wall time; ITL = gap between SSE events of a request; TTFT. Also CPU seconds per output
             token of each part of the deployment (from /proc): the worker's busiest thread (the
             engine), its other threads (gRPC, asyncio), the router process, Ray's daemons.

``ratio`` = served / offline output tokens per second at the same N (target >= 0.9), and whether
served throughput rises (never falls) with N. ``cpu_ratio`` = offline / served CPU time per output
token (all of the deployment's processes): what the ratio is on a core the deployment has to itself,
and far steadier than wall time when other processes share the machine. JSON at ``benchmarks/results/served_vs_offline.json``
(``_quick`` with --quick). The client shares the machine with the server: on a 2-core machine
with other work the absolute figures move with the load (recorded before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ----------------------------------------------------------------------------------- offline
_OFFLINE = r'''
import json, sys, time
import torch
from workers.build import build_engine
from workers.config import EngineConfig
from workers.models.assets.resolve import resolve_model
from workers.sampling_params import SamplingParams
from workers.server.threads import apply
a = json.loads(sys.stdin.read())
config = EngineConfig(model=str(resolve_model(a["model"])), quantization=a["quant"])
apply(config, a["cpus"])
engine = build_engine(config)
engine.warm_up()
params = SamplingParams(max_tokens=a["output_tokens"], temperature=a["temperature"], ignore_eos=True)

def run(prompts, n):
    queue = list(enumerate(prompts)); last = {}; itl = []; tokens = 0
    def admit():
        i, p = queue.pop(0); engine.add_request(f"q{i}", p, params)
    for _ in range(min(n, len(queue))):
        admit()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step(); now = time.perf_counter()
        for o in outs:
            tokens += len(o.new_token_ids)
            if o.request_id in last:
                itl.append(now - last[o.request_id])
            last[o.request_id] = now
            if o.finished:
                last.pop(o.request_id)
                if queue:
                    admit()
    return tokens, time.perf_counter() - t0, itl

run(a["warmup"], a["n"])
cpu = time.process_time()
tokens, wall, itl = run(a["prompts"], a["n"])
print(json.dumps({"tokens": tokens, "wall_s": wall, "itl": itl, "cpu_s": time.process_time() - cpu}))
'''


def offline(args: argparse.Namespace, n: int, work: list[list[int]], warm: list[list[int]]) -> dict[str, Any]:
    payload = {"model": args.model, "quant": args.quant, "cpus": args.cpus, "temperature": args.temperature,
               "output_tokens": args.output_tokens, "n": n, "prompts": work, "warmup": warm}
    from workers.config import EngineConfig
    from workers.server.threads import process_env

    # the environment a pool's worker starts with (OpenMP wait policy, malloc tunables), so both
    # sides run the engine the same way
    env = {**os.environ, **process_env(EngineConfig()), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([*_pin(args.server_cores), sys.executable, "-c", _OFFLINE], input=json.dumps(payload), env=env, capture_output=True,
                         text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tokens": r["tokens"], "wall_s": r["wall_s"], "tokens_per_s": r["tokens"] / r["wall_s"],
            "itl_p50_ms": 1e3 * _pct(r["itl"], 0.5), "itl_p99_ms": 1e3 * _pct(r["itl"], 0.99),
            "cpu_ms_per_token": 1e3 * r["cpu_s"] / r["tokens"]}


def _pin(cores: str | None) -> list[str]:
    """The command prefix that runs a process tree on ``cores`` (taskset), or nothing."""
    return ["taskset", "-c", cores] if cores else []


# ------------------------------------------------------------------------------------ served
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """``duet serve`` in a child process (its own process group), the HTTP port it serves on."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = _free_port()
        # --worker-only-pin: the deployment starts on the client's cores; its worker moves to the
        # server cores once up (pin_worker)
        tree_cores = args.client_cores if args.worker_only_pin else args.server_cores
        cmd = [*_pin(tree_cores), sys.executable, "-m", "cluster.cli", "serve", "--quantization", args.quant, "--cpus-per-replica",
               str(args.cpus), "--ray-num-cpus", str(args.cpus + 1), "--http-port", str(self.port), "--port", "0",
               "--controller-port", "0", "--kv-cache-memory", "1GiB"]
        if args.per_request_streams:  # the plain transport: one Submit call per request
            config = RESULTS / ".served_vs_offline.config.yaml"
            config.write_text("router:\n  multiplex_worker_streams: false\n")
            cmd += ["--config", str(config)]
        self.log = open(RESULTS / ".served_vs_offline.serve.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
        deadline = time.monotonic() + 600
        while "duet: ready" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"duet serve did not come up; see {self.log.name}")
            time.sleep(1)

    def pin_worker(self, cores: str) -> None:
        """Every thread of the worker process onto ``cores`` (taskset -a: the engine and OpenMP threads
        exist already), the rest of the deployment staying where it started."""
        for p in self.processes()["worker"]:
            subprocess.run(["taskset", "-a", "-p", "-c", cores, str(p.pid)], check=True, capture_output=True)

    def processes(self) -> dict[str, list[Any]]:
        import psutil

        root = psutil.Process(self.proc.pid)
        groups: dict[str, list[Any]] = {"router": [root], "worker": [], "ray": []}
        for p in root.children(recursive=True):
            try:
                name = " ".join(p.cmdline())
            except psutil.Error:
                continue
            groups["worker" if "WorkerActor" in name else "ray"].append(p)
        return groups

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _cpu(groups: dict[str, list[Any]]) -> dict[str, float]:
    """CPU seconds so far: per group, and the worker's threads split into its busiest and the rest."""
    out: dict[str, float] = {}
    for name, procs in groups.items():
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
                if name == "worker":
                    threads = sorted((th.user_time + th.system_time for th in p.threads()), reverse=True)
                    out["worker_engine_thread"] = out.get("worker_engine_thread", 0.0) + threads[0]
            except Exception:  # noqa: BLE001 - a process that ended: its time is gone with it
                continue
        out[name] = total
    out["worker_other_threads"] = out.get("worker", 0.0) - out.get("worker_engine_thread", 0.0)
    return out


async def _stream(session: Any, port: int, prompt: list[int], args: argparse.Namespace,
                  itl: list[float], ttft: list[float]) -> int:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": args.output_tokens, "ignore_eos": True,
            "stream": True, "temperature": args.temperature}
    sent = last = time.perf_counter()
    n = 0
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            (itl if n else ttft).append(now - (last if n else sent))
            last = now
            n += 1
    return n


async def _served_run(port: int, n: int, work: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    itl: list[float] = []
    ttft: list[float] = []
    queue = list(work)
    events = 0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def worker() -> None:
            nonlocal events
            while queue:
                events += await _stream(session, port, queue.pop(0), args, itl, ttft)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(n)])
        wall = time.perf_counter() - t0
    tokens = len(work) * args.output_tokens  # ignore_eos: exactly this many (events may merge tokens)
    return {"tokens": tokens, "events": events, "wall_s": wall, "tokens_per_s": tokens / wall,
            "itl_p50_ms": 1e3 * _pct(itl, 0.5), "itl_p99_ms": 1e3 * _pct(itl, 0.99),
            "ttft_p50_ms": 1e3 * _pct(ttft, 0.5)}


def served(dep: Deployment, n: int, work: list[list[int]], warm: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(_served_run(dep.port, n, warm, args))
    groups = dep.processes()
    c0 = _cpu(groups)
    res = asyncio.run(_served_run(dep.port, n, work, args))
    c1 = _cpu(groups)
    res["cpu_ms_per_token"] = {k: 1e3 * (c1[k] - c0.get(k, 0.0)) / res["tokens"] for k in c1}
    res["cpu_ms_per_token"]["total"] = sum(res["cpu_ms_per_token"][k] for k in ("router", "worker", "ray"))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quant", default="q4")
    p.add_argument("--cpus", type=int, default=1, help="the worker's CPUs = torch threads (default 1)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="concurrency 1,8; 2 requests per stream; 32 output tokens")
    p.add_argument("--server-cores", default=None,
                   help="run the offline engine and the whole duet serve tree (Ray, router, worker) on these cores "
                        "(taskset list, e.g. 0) [unpinned]")
    p.add_argument("--client-cores", default=None,
                   help="run this process (the HTTP client) on these cores, e.g. 1 [unpinned]")
    p.add_argument("--worker-only-pin", action="store_true",
                   help="with --server-cores / --client-cores: only the worker process runs on the server cores (as "
                        "the offline engine does); the router and Ray run on the client's cores, as a router on "
                        "another node would [off: the whole duet serve tree on the server cores]")
    p.add_argument("--per-request-streams", action="store_true",
                   help="the router sends each request as its own Submit call (router.multiplex_worker_streams: "
                        "false) instead of on the worker's one SubmitStream")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.worker_only_pin and not (args.server_cores and args.client_cores):
        p.error("--worker-only-pin needs --server-cores and --client-cores")
    if args.client_cores:
        os.sched_setaffinity(0, {int(c) for c in args.client_cores.split(",")})
    if args.quick:
        args.concurrency, args.requests_per_stream, args.output_tokens = "1,8", 2, 32
    levels = [int(x) for x in args.concurrency.split(",")]
    out = args.out or RESULTS / ("served_vs_offline_quick.json" if args.quick else "served_vs_offline.json")
    RESULTS.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "load_avg_before": os.getloadavg(),
                           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "levels": []}
    dep = Deployment(args)
    if args.worker_only_pin:
        dep.pin_worker(args.server_cores)
    try:
        for i, n in enumerate(levels):
            work = prompts(n * args.requests_per_stream, args.prompt_tokens, args.seed + 2 * i)
            warm = prompts(n, args.prompt_tokens, args.seed + 2 * i + 1)
            row: dict[str, Any] = {"concurrency": n}
            row["offline"] = offline(args, n, work, warm)
            row["served"] = served(dep, n, work, prompts(n, args.prompt_tokens, 20_000 + i), args)
            row["ratio"] = row["served"]["tokens_per_s"] / row["offline"]["tokens_per_s"]
            # CPU time per token is what a saturated core turns into throughput, and it moves far
            # less than wall time with other processes' load
            row["cpu_ratio"] = row["offline"]["cpu_ms_per_token"] / row["served"]["cpu_ms_per_token"]["total"]
            res["levels"].append(row)
            cpu = row["served"]["cpu_ms_per_token"]
            print(f"N={n:3d}: offline {row['offline']['tokens_per_s']:7.1f} tok/s (ITL p50 {row['offline']['itl_p50_ms']:.0f} ms)"
                  f"  served {row['served']['tokens_per_s']:7.1f} tok/s (ITL p50 {row['served']['itl_p50_ms']:.0f} ms, "
                  f"p99 {row['served']['itl_p99_ms']:.0f})  ratio {row['ratio']:.2f}, CPU ratio {row['cpu_ratio']:.2f}; "
                  f"offline CPU {row['offline']['cpu_ms_per_token']:.2f} ms/token, served: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
    finally:
        dep.close()
    tps = [r["served"]["tokens_per_s"] for r in res["levels"]]
    res["served_never_falls"] = all(b >= a for a, b in zip(tps, tps[1:]))
    res["min_ratio"] = min(r["ratio"] for r in res["levels"])
    res["min_cpu_ratio"] = min(r["cpu_ratio"] for r in res["levels"])
    res["load_avg_after"] = os.getloadavg()
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}; min served/offline {res['min_ratio']:.2f} (CPU time: {res['min_cpu_ratio']:.2f}; target 0.9); "
          f"served never falls: "
          f"{res['served_never_falls']} (load average {res['load_avg_before']} -> {res['load_avg_after']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
