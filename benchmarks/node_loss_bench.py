"""Recovery after losing a whole Ray node under steady load (a real multi-node Ray on this host),
and after draining one on purpose with live KV migration.

    python -m benchmarks.node_loss_bench                  # SmolLM2, both modes, 3 runs each (~7 min)
    python -m benchmarks.node_loss_bench --mode kill --runs 1 --clients 2

Setup: tests/testkit/multinode.py's LocalCluster: a head without CPUs (this process: router,
controller) and worker nodes a, b, c of {CPU: 2, duet_pool_main: 1000}; ``duet serve`` joins it
(ray.address) with pool ``main`` of 2 replicas x 1 CPU, SPREAD on duet_pool_main (so c is the
spare with room). Load: ``--clients`` closed-loop clients, each streaming greedy requests of
``--tokens`` output tokens (ignore_eos; long enough that the victim's streams outlive a drain's
``drain_settle_s`` and so are migrated rather than finished in place) back to back. After
``--warmup`` s the worker with the most running requests (the victim) loses its node, in one of
two ways (``--mode``):

    kill    its node is killed (raylet, object store and its actors, no grace); Ray re-places the
            lost bundle on the spare node, the controller starts the restarted worker, and the
            router resumes the victim's streams on the other worker by recompute.
    drain   the path of ``duet drain`` / the autoscaler's scale-down (cluster/deploy/ray_actuator.py):
            ``Controller.retire`` lists the victim as draining (routers stop routing to it), and
            after ``drain_settle_s`` its ``stop(grace, peers)`` migrates its running requests with
            their KV to the other worker (live migration, workers/handoff/drain.py), then the controller
            releases it. Then its node is removed (as a machine taken out for maintenance) and the
            actuator scales the pool back to 2 (``RayActuator.scale_to``: the freed slot, re-placed
            on the spare node).

The run goes on until the pool is whole again and every stream in flight at the disruption (t0:
the kill, or the retire) has finished. Figures per run (then medians over ``--runs`` per mode, one
deployment for both modes; a replacement for the removed node joins after every run, so there is
always a spare). A stream's *stall* is its longest wait for a token after t0 (t0 counts as its
first point, so for a killed worker the stall starts at the kill):
    affected            streams the victim was serving when it lost them (the router's ``resumed`` +
                        ``migrated`` counts): of the streams in flight at t0, those with the longest stalls
    migrated, resumed   how the affected streams continued: attached to the migration target
                        (nothing recomputed), or resumed by recompute on another worker
    resume_s            t0 -> the end of the last affected stream's stall (max): when every affected
                        stream streams again
    resume_median_s     the same, median over the affected streams
    stall_max_s         the longest stall of an affected stream (drain: the migration's pause; a
                        drained stream never stops, so resume_s is when that pause ended, <= drained_s)
    unaffected_max_gap_s  the longest stall of the other streams in flight (the surviving worker's)
    steady_gap_s        the median time between two tokens of a stream before t0 (the undisturbed pace)
    pool_full_s         t0 -> the controller lists two serving replicas again (kill: the restarted
                        one; drain: the one the actuator added after the node was removed)
    drained_s           drain only: t0 -> the victim is released (migrated and stopped)
    tokens_recomputed   sum over the resumed streams of (prompt + tokens streamed before the
                        stall): the prefill the resuming worker repeats (a lost node's KV is gone;
                        a migrated stream recomputes nothing). In drain mode a resumed stream is
                        attributed to the longest stalls (a recompute is slower than a migration).
    lost                streams that ended with an error (must be 0)
Node death is detected with the test cluster's health checks (every 0.5 s, dead after 3 misses;
multinode.SYSTEM_CONFIG); Ray's production default takes longer, which adds to the kill mode's times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "node_loss.json"
PROMPT_TOKENS = 32
MAIN = "duet_pool_main"
MODES = ("kill", "drain")
DRAIN_SETTLE_S = 1.0  # = RayActuator's default: routers hear "draining" before the worker refuses work
DRAIN_GRACE_S = 60.0  # how long a migration may take before the rest is aborted (resumed by the router)
KEYS = ("affected", "migrated", "resumed", "resume_s", "resume_median_s", "stall_max_s", "unaffected_max_gap_s",
        "steady_gap_s", "pool_full_s", "tokens_recomputed", "lost")


def _prompt(i: int) -> list[int]:
    """Request i's prompt: distinct token ids per request, so no worker has it in its prefix cache."""
    return [1] + [100 + (i * 7919 + k * 104729) % 40000 for k in range(PROMPT_TOKENS - 1)]


def _deploy(cluster: Any, model: str, namespace: str) -> Any:
    from cluster.config.duet import load_config
    from cluster.deploy.serve import start_deployment

    config = load_config(env={}, overrides={
        "model.name": model, "ray.address": cluster.address, "ray.namespace": namespace, "pool.name": "main",
        "pool.replicas": 2, "pool.cpus_per_replica": 1, "pool.resources_per_rank": {MAIN: 1},
        "pool.engine.kv_cache_memory_bytes": 64 << 20, "router.port": 0, "router.http_port": 0,
        "controller.port": 0, "router.policy": "least_loaded", "controller.poll_interval_s": 0.2,
        "controller.start_timeout_s": 240})
    return start_deployment(config, log_to_driver=False, router_overrides=dict(
        load_poll_interval_s=0.1, load_poll_timeout_s=2.0, stream_failure_cooldown_s=0.5))


async def _client(address: str, tokens: int, stop: asyncio.Event, streams: list[dict]) -> None:
    from router.client import DuetClient, DuetError

    async with DuetClient(address) as client:
        while not stop.is_set():
            s: dict = {"start": time.monotonic(), "times": [], "error": None}
            streams.append(s)
            try:
                async for chunk in client.generate(token_ids=_prompt(len(streams)), max_tokens=tokens, temperature=0,
                                                   ignore_eos=True, timeout=300):
                    s["times"] += [time.monotonic()] * len(chunk.token_ids)
            except DuetError as e:
                s["error"] = f"{e.code.name}: {e}"
            s["end"] = time.monotonic()


def _busiest(d: Any) -> str:
    import grpc

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    def running(endpoint: str) -> int:
        with grpc.insecure_channel(endpoint) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5).num_running
    return max(d.controller.members(), key=lambda m: running(m[1]))[0]


def stall(times: list[float], end: float, t0: float) -> tuple[float, float, int]:
    """(longest wait for a token after t0, when it ended, tokens streamed before it began) of one
    stream: t0 is its first point, its end the last when it streamed nothing more."""
    points = [t0] + [t for t in times if t >= t0]
    if len(points) == 1:
        points.append(end)
    gap, i = max((b - a, i) for i, (a, b) in enumerate(zip(points, points[1:], strict=False)))
    began = points[i]
    return gap, points[i + 1], sum(1 for t in times if t <= began)


def figures(in_flight: list[dict], streams: list[dict], t0: float, migrated: int, resumed: int) -> dict[str, Any]:
    """The run's figures (module docstring) from the client-side token times and the router's counts."""
    stalls = sorted((stall(s["times"], s["end"], t0) for s in in_flight), reverse=True)
    before = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:], strict=False) if a < b < t0]
    affected = stalls[:migrated + resumed]
    ends = [e - t0 for _, e, _ in affected]
    return {"in_flight": len(in_flight), "affected": len(affected), "migrated": migrated, "resumed": resumed,
            "resume_s": max(ends, default=0.0), "resume_median_s": statistics.median(ends) if ends else 0.0,
            "stall_max_s": max((g for g, _, _ in affected), default=0.0),
            "unaffected_max_gap_s": max((g for g, _, _ in stalls[len(affected):]), default=0.0),
            "steady_gap_s": statistics.median(before) if before else 0.0,
            "tokens_recomputed": sum(PROMPT_TOKENS + n for _, _, n in affected[:resumed]),
            "lost": sum(1 for s in streams if s["error"]), "errors": sorted({s["error"] for s in streams if s["error"]})}


async def _kill(cluster: Any, d: Any, victim: str, node: str) -> tuple[Any, dict[str, float]]:
    """Kill the victim's node -> (a predicate: the pool is whole again, extra figures)."""
    restarts = d.controller.num_restarts
    await asyncio.to_thread(cluster.remove, node)
    return lambda: d.controller.num_restarts > restarts and len(d.controller.members()) == 2, {}


async def _drain(cluster: Any, d: Any, actuator: Any, victim: str, node: str, t0: float) -> tuple[Any, dict]:
    """Drain the victim by live migration (the autoscaler's scale-down path), remove its node, scale
    the pool back to 2 -> (a predicate: the pool is whole again, extra figures)."""
    d.controller.retire(victim, drain_grace_s=DRAIN_GRACE_S, drain_settle_s=DRAIN_SETTLE_S)
    while any(r["worker_id"] == victim for r in d.controller.describe()):
        assert time.monotonic() - t0 < DRAIN_GRACE_S + 30, f"{victim} not released within {DRAIN_GRACE_S + 30} s"
        await asyncio.sleep(0.05)
    drained = time.monotonic() - t0
    await asyncio.to_thread(cluster.remove, node)
    await asyncio.to_thread(actuator.scale_to, d.pools[0].name, 2)
    return lambda: len(d.controller.members()) == 2, {"drained_s": drained}


async def _one_run(cluster: Any, d: Any, actuator: Any, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    stop, streams = asyncio.Event(), list[Any]()
    clients = [asyncio.ensure_future(_client(d.address, args.tokens, stop, streams)) for _ in range(args.clients)]
    await asyncio.sleep(args.warmup)
    victim = _busiest(d)
    pool = d.pools[0]
    node = cluster.name_of(pool.bundle_nodes(pool.replica(victim))[0])
    before = d.router.stats()["requests"]
    in_flight = [s for s in streams if "end" not in s]
    t0 = time.monotonic()
    if mode == "kill":
        whole, extra = await _kill(cluster, d, victim, node)
    else:
        whole, extra = await _drain(cluster, d, actuator, victim, node, t0)
    full_at = None
    while full_at is None or any("end" not in s for s in in_flight):
        if full_at is None and whole():
            full_at = time.monotonic()
        assert time.monotonic() - t0 < 300, f"{mode}: no recovery within 300 s"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*clients)
    after = d.router.stats()["requests"]
    migrated, resumed = (after.get(k, 0) - before.get(k, 0) for k in ("migrated", "resumed"))
    return {"mode": mode, "node": node, "worker": victim, **figures(in_flight, streams, t0, migrated, resumed),
            "pool_full_s": full_at - t0, **extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2)")
    p.add_argument("--mode", choices=("kill", "drain", "both"), default="both",
                   help="kill the victim's node, drain it by live migration first, or both (default)")
    p.add_argument("--runs", type=int, default=3, help="runs per mode")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=192,
                   help="output tokens per request: long enough that streams outlive the drain's settle")
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name in ("runs", "clients", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup <= 0:
        p.error("--warmup must be > 0")
    modes = MODES if args.mode == "both" else (args.mode,)
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import ray

    from cluster.deploy.ray_actuator import RayActuator
    from testkit.multinode import LocalCluster
    from workers.models.assets.prepare import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    cluster = LocalCluster()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for name in "abc":
            cluster.add(name, 2, {MAIN: 1000})
        d = _deploy(cluster, model, "duet_node_loss")
        try:
            actuator = RayActuator(d.pools, d.controller, drain_grace_s=DRAIN_GRACE_S, drain_settle_s=DRAIN_SETTLE_S)
            for _ in range(args.runs):
                for mode in modes:
                    runs[mode].append(asyncio.run(_one_run(cluster, d, actuator, mode, args)))
                    print(json.dumps(runs[mode][-1]), flush=True)
                    cluster.restore()  # a replacement node: the spare for the next run
        finally:
            d.stop()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "model": model, "clients": args.clients,
                              "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS, "drain_settle_s": DRAIN_SETTLE_S,
                              "modes": {}}
    for mode in modes:
        keys = KEYS + (("drained_s",) if mode == "drain" else ())
        median = {k: statistics.median(r[k] for r in runs[mode]) for k in keys}
        result["modes"][mode] = {"runs": runs[mode], "median": median}
        print(f"{mode}: median over {len(runs[mode])} runs:", json.dumps(median), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
