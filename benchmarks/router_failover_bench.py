"""Streams lost and stalls when one of 3 routers is killed every 20 s under steady load (issue 33 (a)).

    python -m benchmarks.router_failover_bench [--seconds 180] [--kill-every 20] [--streams 16]

Setup, all in this process: ``--workers`` echo workers (cluster/bench/echo_worker.py: ``--first-token-ms``,
then one id every ``--gap-ms``, ``--max-tokens`` ids) and 3 routers on fixed ports. ``--streams``
closed-loop clients, each a ``DuetClient`` given all 3 routers (router/client.py), client i starting on
router i mod 3 (``DuetClient`` tries its targets in order from the last one that worked). Every
``--kill-every`` seconds the next router in turn is stopped with no grace (its streams are cut as if it
died) and started again on the same port 1 s later. Baseline in the same run: the first
``--kill-every`` seconds, before any kill.

Reported:
    requests, lost           streams that ended with an error (target: 0)
    resumed                  streams that continued on another router
    stall_max_s              per resumed stream, the largest gap between two chunks (the client's view of
                             the failover: cut, reconnect, the new router's recompute); p50 / p99 / max
                             (target: max <= 1 s), next to the same for unbroken streams
    ttft_p50_ms, ttft_p99_ms before the first kill and over the whole run

One process (the routers share the GIL with the clients and workers); the machine is shared: the
load average is written with the results. Writes JSON to ``--out`` (default
benchmarks/results/router_failover_bench.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import socket
import threading
import time
from pathlib import Path

from cluster.bench.echo_worker import start_echo_worker
from router.client import DuetClient
from router.config import RouterConfig
from router.server import serve_router

DEFAULT_MODEL = Path.home() / ".cache" / "duet" / "models" / "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _q(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


async def _client(i: int, targets: list[str], args: argparse.Namespace, stop_at: float, rows: list[dict]) -> None:
    rng = random.Random(i)
    async with DuetClient(targets[i % 3:] + targets[:i % 3], max_resumes=5) as client:
        while time.monotonic() < stop_at:
            ids = [rng.randrange(1000, 20000) for _ in range(32)]
            sent = time.monotonic()
            last, first, gaps, tokens, error = sent, None, [], 0, ""
            try:
                async for chunk in client.generate(token_ids=ids, max_tokens=args.max_tokens, ignore_eos=True,
                                                   timeout=60):
                    now = time.monotonic()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    tokens += len(chunk.token_ids)
            except Exception as e:  # noqa: BLE001 - a lost stream is the measurement
                error = f"{type(e).__name__}: {e}"
            rows.append({"sent": sent, "ttft": (first - sent) if first else None, "max_gap": max(gaps, default=0.0),
                         "tokens": tokens, "error": error})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--first-token-ms", type=float, default=20.0)
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="tokenizer directory")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/router_failover_bench.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    load_before = os.getloadavg()
    loop = _Loop()
    workers = [loop.run(start_echo_worker(first_token_ms=args.first_token_ms, gap_ms=args.gap_ms))
               for _ in range(args.workers)]
    members = [(f"e{i}", f"127.0.0.1:{port}") for i, (_, port) in enumerate(workers)]
    ports = [_free_port() for _ in range(3)]
    config = RouterConfig(tokenizer_path=str(args.model_path), port=0, http_port=0, policy="least_loaded",
                          max_in_flight=1024)

    def start(i: int):
        from dataclasses import replace
        return serve_router(replace(config, port=ports[i]), members)

    routers = [start(i) for i in range(3)]
    targets = [r.address for r in routers]
    rows: list[dict] = []
    kills: list[float] = []
    t0 = time.monotonic()
    stop_at = t0 + args.seconds

    def killer() -> None:
        n = 0
        while True:
            at = t0 + args.kill_every * (n + 1)
            if at >= stop_at - 2:
                return
            time.sleep(max(0.0, at - time.monotonic()))
            i = n % 3
            routers[i].stop(0)
            kills.append(time.monotonic())
            time.sleep(1.0)
            routers[i] = start(i)
            n += 1

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()

    async def drive() -> None:
        await asyncio.gather(*(_client(i, targets, args, stop_at, rows) for i in range(args.streams)))

    asyncio.run(drive())
    thread.join()
    for r in routers:
        r.stop(0)
    for server, _ in workers:
        loop.run(server.stop(0))

    def in_kill_window(row: dict) -> bool:  # a stream running while a router died
        end = row["sent"] + (row["ttft"] or 0) + row["max_gap"] + 5
        return any(row["sent"] <= k <= end for k in kills)

    base = [r for r in rows if r["sent"] < t0 + args.kill_every - 2]
    lost = [r for r in rows if r["error"]]
    hit = [r for r in rows if not r["error"] and in_kill_window(r) and r["max_gap"] > 5 * args.gap_ms / 1e3]
    calm = [r for r in rows if not r["error"] and not in_kill_window(r)]
    report = {
        "benchmark": "router_failover_bench", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()}, "kills": len(kills), "requests": len(rows),
        "lost": len(lost), "lost_errors": sorted({r["error"] for r in lost})[:5],
        "resumed_or_stalled": len(hit),
        "stall_max_s_resumed": {"p50": _q([r["max_gap"] for r in hit], 0.5), "p99": _q([r["max_gap"] for r in hit], 0.99),
                                "max": max((r["max_gap"] for r in hit), default=None)},
        "stall_max_s_unbroken": {"p50": _q([r["max_gap"] for r in calm], 0.5),
                                 "p99": _q([r["max_gap"] for r in calm], 0.99)},
        "ttft_ms_before_kills": {"p50": 1e3 * (_q([r["ttft"] for r in base if r["ttft"]], 0.5) or 0),
                                 "p99": 1e3 * (_q([r["ttft"] for r in base if r["ttft"]], 0.99) or 0)},
        "ttft_ms_all": {"p50": 1e3 * (_q([r["ttft"] for r in rows if r["ttft"]], 0.5) or 0),
                        "p99": 1e3 * (_q([r["ttft"] for r in rows if r["ttft"]], 0.99) or 0)},
    }
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
