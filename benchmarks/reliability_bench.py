"""Reliability figures on a real deployment (embedded Ray, SmolLM2): chaos, overload and soak.

    python -m benchmarks.reliability_bench                 # all phases (~4 min), JSON to benchmarks/results/
    python -m benchmarks.reliability_bench --quick         # smoke run (~1.5 min)
    python -m benchmarks.reliability_bench --phases chaos --chaos-seconds 300

Phases (each on its own deployment: ``--workers`` workers x 1 CPU, round-robin routing):

chaos     A closed loop of ``--concurrency`` clients sends greedy requests (the shipped prompts,
          16-48 output tokens, ``ignore_eos``) for ``--chaos-seconds``; every ``--kill-every`` s
          one worker chosen at random is killed (``ray.kill``; Ray restarts it). Every request is
          accounted for:
              completed          finished with a finish reason
              failed_retryable   ended with UNAVAILABLE (the client may retry)
              failed_other       ended with any other status (a bug unless explained)
              lost               neither within its deadline (a hung stream): must be 0
          plus the router's own counts of requests retried before their first token and resumed
          after a worker died mid-stream, and ``mismatches``: completed outputs that differ from
          the same request's output on the undisturbed deployment, measured first (must be 0).
overload  ``--burst-factor`` x the router's admission capacity (max_in_flight + max_queue) sent
          at once: how many complete, how many are shed with RESOURCE_EXHAUSTED, how fast
          (p50/p99 time to the rejection), and the peak RSS of the router's process and of every
          worker process meanwhile (sampled every 20 ms).
fuzz      ``--fuzz-cases`` hypothesis-generated requests and as many malformed payloads
          (benchmarks/fuzz_requests.py) against the real stack: the statuses seen, any answer
          outside the well-formed set (must be none), and whether the router still serves after.
soak      Poisson arrivals at ``--soak-rate`` req/s for ``--soak-seconds``: RSS of the router and
          workers each second (first vs last minute's mean, and a least-squares slope in MB/min),
          every KV block free once idle, and after shutdown no actor, placement group or worker
          process left behind.

The loops are bounded in count and time and talk only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cluster.bench.load_gen import load_prompts
from cluster.bench.metrics import percentile

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "reliability.json"
NAMESPACE = "duet_reliability"


# ------------------------------------------------------------------ deployment
def start(workers: int, *, max_in_flight: int = 128, max_queue: int = 512, namespace: str = NAMESPACE,
          kv_bytes: int = 64 << 20) -> Any:
    """A deployment on the current (or a new embedded) Ray: ``workers`` x 1 CPU, round robin."""
    from cluster.config.duet import load_config
    from cluster.deploy.serve import start_deployment

    config = load_config(env={}, overrides={
        "pool.replicas": workers, "pool.cpus_per_replica": 1, "pool.engine.kv_cache_memory_bytes": kv_bytes,
        "router.port": 0, "router.http_port": 0, "controller.port": 0, "router.policy": "round_robin", "router.max_in_flight": max_in_flight,
        "router.max_queue": max_queue, "ray.namespace": namespace, "controller.poll_interval_s": 0.2,
        "controller.start_timeout_s": 300})
    return start_deployment(config, log_to_driver=False, router_overrides=dict(
        load_poll_interval_s=0.1, load_poll_timeout_s=2.0, stream_failure_cooldown_s=0.5, worker_wait_s=20.0,
        max_resumes=4))


def worker_pids(d: Any) -> list[int]:
    import ray

    pids = []
    for r in d.pool.replicas:
        try:
            pids.append(int(ray.get(r.actor.info.remote(), timeout=10)["pid"]))
        except Exception:  # noqa: BLE001 - a worker being restarted has no pid to report now
            pass
    return pids


def rss_mb(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


# ------------------------------------------------------------------ requests
@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int


def jobs(n: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    prompts = load_prompts()
    return [Job(prompts[i % len(prompts)], rng.randint(16, 48)) for i in range(n)]


@dataclass
class Outcome:
    status: str  # "OK" or a gRPC status name, or "LOST"
    token_ids: list[int] = field(default_factory=list)
    seconds: float = 0.0


async def send(client: Any, job: Job, timeout: float) -> Outcome:
    from router.client import DuetError

    t0 = time.monotonic()
    ids: list[int] = []
    try:
        async with asyncio.timeout(timeout + 5):  # a stream that outlives its own deadline is lost
            async for chunk in client.generate(messages=[{"role": "user", "content": job.prompt}],
                                               max_tokens=job.max_tokens, temperature=0, ignore_eos=True,
                                               timeout=timeout):
                ids.extend(chunk.token_ids)
    except DuetError as e:
        return Outcome(e.code.name, ids, time.monotonic() - t0)
    except TimeoutError:
        return Outcome("LOST", ids, time.monotonic() - t0)
    return Outcome("OK", ids, time.monotonic() - t0)


# ------------------------------------------------------------------ chaos
async def chaos(d: Any, *, seconds: float, kill_every: float, concurrency: int, seed: int,
                distinct_jobs: int = 32, timeout: float = 120.0) -> dict[str, Any]:
    """The chaos phase (see the module docstring) on deployment ``d``, cycling over
    ``distinct_jobs`` requests whose undisturbed outputs are measured first."""
    import ray

    from router.client import DuetClient

    pool = jobs(distinct_jobs, seed)
    async with DuetClient(d.address) as client:
        reference = {}
        for job in dict.fromkeys(pool):  # the undisturbed outputs, one request at a time
            out = await send(client, job, timeout)
            assert out.status == "OK", f"reference request failed: {out.status}"
            reference[job] = out.token_ids
        stats0 = d.router.stats()["requests"]
        rng = random.Random(seed)
        outcomes: list[tuple[Job, Outcome]] = []
        kills: list[dict[str, Any]] = []
        t_end = time.monotonic() + seconds

        async def client_loop(i: int) -> None:
            k = i
            while time.monotonic() < t_end:
                job = pool[k % len(pool)]
                k += concurrency
                outcomes.append((job, await send(client, job, timeout)))

        async def killer() -> None:
            while (now := time.monotonic()) + kill_every < t_end:
                await asyncio.sleep(kill_every)
                victim = rng.choice(d.pool.replicas)
                ray.kill(victim.actor, no_restart=False)
                kills.append({"t": round(now + kill_every - (t_end - seconds), 2), "worker": victim.worker_id})
                logger.info("chaos: killed %s", victim.worker_id)

        await asyncio.gather(killer(), *(client_loop(i) for i in range(concurrency)))
    stats1 = d.router.stats()["requests"]
    counts = {s: sum(o.status == s for _, o in outcomes) for s in {o.status for _, o in outcomes}}
    completed = counts.get("OK", 0)
    return {
        "seconds": seconds, "kill_every_s": kill_every, "concurrency": concurrency, "kills": kills,
        "sent": len(outcomes), "completed": completed, "failed_retryable": counts.get("UNAVAILABLE", 0),
        "lost": counts.get("LOST", 0),
        "failed_other": {s: n for s, n in counts.items() if s not in ("OK", "UNAVAILABLE", "LOST")},
        "retried": stats1.get("retried", 0) - stats0.get("retried", 0),
        "resumed": stats1.get("resumed", 0) - stats0.get("resumed", 0),
        "mismatches": sum(o.status == "OK" and o.token_ids != reference[j] for j, o in outcomes),
        "worker_restarts": d.controller.num_restarts,
    }


# ------------------------------------------------------------------ overload
async def overload(d: Any, *, burst: int, timeout: float = 120.0) -> dict[str, Any]:
    from router.client import DuetClient

    pids = {"router": [os.getpid()], "workers": worker_pids(d)}
    peak = {k: sum(rss_mb(v).values()) for k, v in pids.items()}
    base = dict(peak)
    done = asyncio.Event()

    async def sampler() -> None:
        while not done.is_set():
            for k, v in pids.items():
                peak[k] = max(peak[k], sum(rss_mb(v).values()))
            await asyncio.sleep(0.02)

    async with DuetClient(d.address) as client:
        work = jobs(burst, 1)
        task = asyncio.create_task(sampler())
        outs = await asyncio.gather(*(send(client, j, timeout) for j in work))
        done.set()
        await task
    rejected = [o.seconds * 1e3 for o in outs if o.status == "RESOURCE_EXHAUSTED"]
    counts = {s: sum(o.status == s for o in outs) for s in {o.status for o in outs}}
    return {
        "burst": burst, "statuses": counts,
        "time_to_resource_exhausted_ms": {"p50": _pct(rejected, 50), "p99": _pct(rejected, 99),
                                          "max": max(rejected, default=None)},
        "completed_e2e_p50_s": _pct([o.seconds for o in outs if o.status == "OK"], 50),
        "rss_mb": {k: {"before": round(base[k], 1), "peak": round(peak[k], 1)} for k in pids},
    }


def _pct(values: list[float], q: float) -> float | None:
    """cluster.bench.metrics.percentile, with None (valid JSON) instead of NaN when nothing was measured."""
    return percentile(values, q) if values else None


# ------------------------------------------------------------------ soak
async def soak(d: Any, *, seconds: float, rate: float, seed: int, timeout: float = 120.0) -> dict[str, Any]:
    from router.client import DuetClient

    pids = {"router": [os.getpid()], "workers": worker_pids(d)}
    series: dict[str, list[tuple[float, float]]] = {k: [] for k in pids}
    rng = random.Random(seed)
    t0 = time.monotonic()
    tasks: list[asyncio.Task[Outcome]] = []
    async with DuetClient(d.address) as client:
        work = jobs(10_000, seed)
        next_sample, i = t0, 0
        while (now := time.monotonic()) < t0 + seconds:
            if now >= next_sample:
                for k, v in pids.items():
                    series[k].append((now - t0, sum(rss_mb(v).values())))
                next_sample += 1.0
            tasks.append(asyncio.create_task(send(client, work[i % len(work)], timeout)))
            i += 1
            await asyncio.sleep(min(rng.expovariate(rate), max(0.0, next_sample - time.monotonic())) or 0.001)
        outs = await asyncio.gather(*tasks)
    idle_deadline = time.monotonic() + 30
    while (used := _kv_used(d)) and time.monotonic() < idle_deadline:
        await asyncio.sleep(0.2)
    return {
        "seconds": seconds, "rate": rate, "sent": len(outs),
        "statuses": {s: sum(o.status == s for o in outs) for s in {o.status for o in outs}},
        "kv_blocks_used_when_idle": used,
        "rss_mb": {k: _trend(v) for k, v in series.items()},
    }


def _kv_used(d: Any) -> int:
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    total = 0
    for _, endpoint in d.controller.members():
        with grpc.insecure_channel(endpoint) as ch:
            total += worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5).kv_blocks_used
    return total


def _trend(points: list[tuple[float, float]]) -> dict[str, float | None]:
    if len(points) < 2:
        return {"first_mb": None, "last_mb": None, "slope_mb_per_min": None}
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    window = max(1, len(ys) // 4)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    return {"first_mb": round(statistics.fmean(ys[:window]), 1), "last_mb": round(statistics.fmean(ys[-window:]), 1),
            "slope_mb_per_min": round(slope * 60, 2)}


def leftovers(namespace: str, placement_group: Any, wait_s: float = 30.0) -> dict[str, Any]:
    """After a deployment stopped: its named actors, its placement group's state, and whether
    every CPU of the Ray cluster is free again (waits up to ``wait_s`` for the last to settle)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        out = {"actors": [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["namespace"] == namespace],
               "placement_group": ray.util.placement_group_table(placement_group).get("state"),
               "cpus_free": ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)}
        if (not out["actors"] and out["cpus_free"]) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


# ------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster.bench.report import code_version as _code_version, machine as _machine

    res: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "machine": _machine(),
                           "code": _code_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    ray.init(num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False)
    try:
        if "chaos" in args.phases:
            with start(args.workers) as d:
                res["chaos"] = asyncio.run(chaos(d, seconds=args.chaos_seconds, kill_every=args.kill_every,
                                                 concurrency=args.concurrency, seed=args.seed))
        if "overload" in args.phases:
            with start(args.workers, max_in_flight=8, max_queue=16) as d:
                res["overload"] = asyncio.run(overload(d, burst=args.burst_factor * 24))
                res["overload"]["capacity"] = 24
        if "fuzz" in args.phases:
            from benchmarks.fuzz_requests import fuzz

            with start(args.workers) as d:
                t0 = time.monotonic()
                res["fuzz"] = fuzz(d.address, cases=args.fuzz_cases, timeout=10.0)
                res["fuzz"]["seconds"] = round(time.monotonic() - t0, 1)
        if "soak" in args.phases:
            d = start(args.workers)
            pids = worker_pids(d)
            try:
                res["soak"] = asyncio.run(soak(d, seconds=args.soak_seconds, rate=args.soak_rate, seed=args.seed))
            finally:
                pg = d.pool.placement_group
                d.stop()
            time.sleep(2)
            res["soak"]["after_shutdown"] = {**leftovers(NAMESPACE, pg),
                                             "worker_processes_alive": sorted(rss_mb(pids))}
    finally:
        ray.shutdown()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="chaos,overload,fuzz,soak",
                   help="comma-separated subset of chaos,overload,fuzz,soak")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chaos-seconds", type=float, default=90.0)
    p.add_argument("--kill-every", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--burst-factor", type=int, default=10, help="burst = this x admission capacity (default 10)")
    p.add_argument("--fuzz-cases", type=int, default=150, help="generated requests (and as many malformed payloads)")
    p.add_argument("--soak-seconds", type=float, default=120.0)
    p.add_argument("--soak-rate", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="chaos 30 s, soak 30 s")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if bad := set(args.phases) - {"chaos", "overload", "fuzz", "soak"}:
        p.error(f"--phases: unknown {sorted(bad)}")
    if args.quick:
        args.chaos_seconds, args.soak_seconds = 30.0, 30.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k in ("chaos", "overload", "fuzz", "soak")}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
