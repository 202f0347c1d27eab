"""1 vs 2 vs 3 routers, each its own process, in front of the same real workers (issue 33 (b)).

    python -m benchmarks.routers_real_bench [--workers 2] [--streams 16] [--seconds 30] [--routers 1 2 3]
    python -m benchmarks.routers_real_bench --echo [--echo-first-token-ms 20] [--echo-gap-ms 2] ...

Setup: ``duet serve --no-router`` (an embedded Ray, ``--workers`` SmolLM2-135M worker replicas of one
CPU each, the controller's Membership service), then for each router count N, N ``duet router``
processes following that member list (the deployment a platform runs: routers as their own pods in
front of one worker pool). ``--streams`` closed-loop gRPC clients in this process, client i always on
router i mod N, send a random 64-token prompt and read ``--max-tokens`` tokens (ignore_eos), again
and again for ``--seconds`` per point after a warm-up of ``--warmup`` seconds. The routers run
prefix_aware (the default). Reported per N: completed requests/s, output tokens/s, TTFT p50 / p99,
and the CPU seconds each router process used per request (from /proc). Routers are stopped with
SIGTERM between points; the workers stay up, so every point runs on the same warm workers.

What it answers: whether adding routers costs real-worker throughput or latency (they share the
workers' load reports and prefix holdings; each is another hop's worth of CPU on the host). With real
workers the workers are the bottleneck.

``--echo``: the router-bound arm. Instead of ``duet serve``, ``--workers`` echo workers
(cluster/bench/echo_worker.py: no model work, ``--echo-first-token-ms`` then one id every
``--echo-gap-ms``), each its own process, and this process serves their member list on a
Membership service (as the controller would); the N routers are ``duet router`` processes as above.
With ids streamed every few milliseconds the routers' own work (detokenization, streaming, routing)
is what limits throughput. On a host with fewer cores than routers + echo workers + this process,
they share the cores: the result says how routers scale *on this host*, not on a router per core.
Writes JSON to ``--out`` (default benchmarks/results/routers_real_bench.json, or
routers_real_bench_echo.json with ``--echo``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.routers_bench import _quantile
from protos.duet.v1 import duet_pb2, duet_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
DUET = [sys.executable, "-m", "cluster.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUET_", "RAY_")) or k == "DUET_CACHE_DIR"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Proc:
    """A child process whose output lines are collected by a thread (so its pipe never fills)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log.open("w")
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode} before /{pattern}/; see {self.log.name}")
            time.sleep(0.2)
        raise TimeoutError(f"no /{pattern}/ within {timeout:.0f} s; see {self.log.name}")

    def cpu_seconds(self) -> float:
        """user + system CPU seconds of the process so far (/proc/<pid>/stat)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


async def _client(i: int, address: str, max_tokens: int, start_at: float, stop_at: float,
                  ttfts: list[float], counts: list[int]) -> None:
    import random

    rng = random.Random(i)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = duet_pb2_grpc.DuetStub(channel)
        while time.monotonic() < stop_at:
            prompt = [rng.randrange(1000, 20000) for _ in range(64)]
            req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=prompt),
                                           sampling=duet_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            sent, first, tokens = time.monotonic(), None, 0
            async for chunk in stub.Generate(req, timeout=120):
                tokens += len(chunk.token_ids)
                if first is None:
                    first = time.monotonic()
            if sent >= start_at and time.monotonic() <= stop_at and first is not None:  # wholly inside the window
                ttfts.append(first - sent)
                counts[0] += 1
                counts[1] += tokens


def _start_echo(args: argparse.Namespace, logs: Path) -> tuple[list[_Proc], Any]:
    """``--workers`` echo worker processes and a Membership service listing them (this process)."""
    from cluster.deploy.membership_service import StaticMembers, serve_membership

    echoes = [_Proc([sys.executable, "-m", "cluster.bench.echo_worker", "--port", "0", "--first-token-ms",
                     str(args.echo_first_token_ms), "--gap-ms", str(args.echo_gap_ms)], logs / f"echo_{i}.log")
              for i in range(args.workers)]
    ports = [int(e.wait_for(r"ECHO_WORKER_PORT=(\d+)", timeout=120).group(1)) for e in echoes]
    members = StaticMembers([(f"e{i}", f"127.0.0.1:{p}") for i, p in enumerate(ports)])
    service = serve_membership(members, "127.0.0.1", 0)
    return echoes, service


def run_point(args: argparse.Namespace, n: int, membership: str, logs: Path) -> dict[str, Any]:
    ports = [_free_port() for _ in range(n)]
    routers = [_Proc([*DUET, "router", "--membership", membership, "--model", str(args.model), "--port", str(p),
                      "--http-port", "0"], logs / f"router_{n}_{i}.log") for i, p in enumerate(ports)]
    try:
        for r in routers:
            r.wait_for(r"duet router: serving", timeout=180)
        time.sleep(1.0)  # a few membership / load polls
        cpu0 = [r.cpu_seconds() for r in routers]
        ttfts: list[float] = []
        counts = [0, 0]
        t0 = time.monotonic()
        start_at, stop_at = t0 + args.warmup, t0 + args.warmup + args.seconds

        async def drive() -> None:
            await asyncio.gather(*(_client(i, f"127.0.0.1:{ports[i % n]}", args.max_tokens, start_at, stop_at,
                                           ttfts, counts) for i in range(args.streams)))

        asyncio.run(drive())
        cpu = sum(r.cpu_seconds() - c for r, c in zip(routers, cpu0))
    finally:
        for r in routers:
            r.stop()
    return {"routers": n, "requests": counts[0], "window_s": args.seconds,
            "throughput_rps": round(counts[0] / args.seconds, 2), "output_tok_s": round(counts[1] / args.seconds, 1),
            "ttft_p50_ms": round(1e3 * _quantile(ttfts, 0.5), 1), "ttft_p99_ms": round(1e3 * _quantile(ttfts, 0.99), 1),
            "router_cpu_ms_per_request": round(1e3 * cpu / max(counts[0], 1), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--routers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="a model name or path (as `duet serve --model`)")
    p.add_argument("--echo", action="store_true", help="echo workers (one process each) instead of real ones: "
                   "the router-bound arm")
    p.add_argument("--echo-first-token-ms", type=float, default=20.0)
    p.add_argument("--echo-gap-ms", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / f"routers_real_bench{'_echo' if args.echo else ''}.json"
    logs = args.out.parent / "routers_real_bench_logs"
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    points = []
    if args.echo:
        echoes, service = _start_echo(args, logs)
        try:
            for n in args.routers:
                points.append(run_point(args, n, service.address, logs))
                print(json.dumps(points[-1]), flush=True)
        finally:
            service.stop()
            for e in echoes:
                e.stop()
    else:
        controller_port = _free_port()
        serve = _Proc([*DUET, "serve", "--no-router", "--model", str(args.model), "--replicas", str(args.workers),
                       "--controller-port", str(controller_port), "--ray-num-cpus", str(args.workers),
                       "--kv-cache-memory", "256MiB"], logs / "serve.log")
        try:
            serve.wait_for(r"duet: ready \(no router\)", timeout=600)
            for n in args.routers:
                points.append(run_point(args, n, f"127.0.0.1:{controller_port}", logs))
                print(json.dumps(points[-1]), flush=True)
        finally:
            serve.stop(timeout=120)
    base = points[0]["output_tok_s"] if points else 0
    for pt in points:
        pt["vs_first"] = round(pt["output_tok_s"] / base, 3) if base else None
    result = {"benchmark": "routers_real_bench_echo" if args.echo else "routers_real_bench", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "host": platform.node(), "cpus": os.cpu_count(), "loadavg_1m_before": load_before,
              "loadavg_1m_after": os.getloadavg()[0], "settings": {k: str(v) for k, v in vars(args).items()},
              "points": points}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'routers':>7} {'req/s':>7} {'tok/s':>7} {'vs 1':>6} {'TTFT p50':>9} {'p99':>7} {'router CPU ms/req':>18}")
    for pt in points:
        print(f"{pt['routers']:>7} {pt['throughput_rps']:>7} {pt['output_tok_s']:>7} {pt['vs_first']:>6} "
              f"{pt['ttft_p50_ms']:>9} {pt['ttft_p99_ms']:>7} {pt['router_cpu_ms_per_request']:>18}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
