"""Recovery after losing a whole Ray node under steady load (a real multi-node Ray on this host):
the node killed (``kill``) or drained on purpose with live KV migration first (``drain``).

    python -m benchmarks.node_loss_bench                  # SmolLM2, both modes, 3 runs each (~6 min)
    python -m benchmarks.node_loss_bench --mode drain --runs 1 --clients 2

Setup: tests/testkit/multinode.py's LocalCluster: a head without CPUs (this process: router,
controller) and worker nodes a, b, c of {CPU: 2, duet_pool_main: 1000}; ``duet serve`` joins it
(ray.address) with pool ``main`` of 2 replicas x 1 CPU, SPREAD on duet_pool_main (so c is the
spare with room). Load: ``--clients`` closed-loop clients, each streaming greedy requests of
``--tokens`` output tokens (ignore_eos) back to back. After ``--warmup`` s (the event, t0) the
worker with the most running requests loses its node, by ``--mode``:
    kill    its node is killed (raylet, object store and its actors, no grace); Ray re-places the
            lost bundle on the spare node and restarts the worker there, the controller starts it.
    drain   the path of a planned scale-down (the autoscaler's RayActuator, Controller.retire):
            the worker is listed as draining (routers stop routing to it), after the settle time
            it migrates its running requests with their KV to the pool's other worker
            (workers/drain.py) and is released; then its node is removed, and
            ``RayActuator.scale_to(pool, 2)`` adds a replacement (Ray re-places the freed bundle
            on the spare node). Migration cannot save a killed node's KV, only a drained one's.
The run goes on until the pool is whole again and every stream in flight at t0 has finished.
``--mode both`` (the default) alternates kill and drain runs on one deployment.

Figures per run (then medians per mode over ``--runs``; a replacement for the removed node joins
between runs, so there is always a spare). A stream's *stall* is its longest wait for a token
after t0, counting from t0 (from its last token when it ended without one):
    affected            streams the lost worker was serving (the router's ``resumed`` +
                        ``migrated`` counts): of the streams in flight at t0, those that stalled longest
    resume_s            the largest stall of an affected stream (kill: t0 -> its first token again)
    resume_median_s     the same, median over the affected streams
    unaffected_max_gap_s  the largest stall of the other streams in flight (the surviving worker's)
    pool_full_s         t0 -> the controller lists two replicas up again, one of them the restarted
                        (kill) or new (drain) worker, loaded and serving
    tokens_recomputed   sum over resumed streams of (prompt + tokens streamed before t0): the
                        prefill a resuming worker repeats (nothing of a lost node's KV survives);
                        a migrated stream recomputes nothing. The router counts resumes, not which
                        stream resumed: the ``resumed`` longest-stalled affected streams are counted
    migrated, resumed   the router's counts for the run
    drain_s             (drain) t0 -> the worker released (drained, actors killed)
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


def _prompt(i: int) -> list[int]:
    """Request i's prompt: distinct token ids per request, so no worker has it in its prefix cache."""
    return [1] + [100 + (i * 7919 + k * 104729) % 40000 for k in range(PROMPT_TOKENS - 1)]
MAIN = "duet_pool_main"


def _deploy(cluster: Any, model: str, namespace: str) -> Any:
    from cluster.config import load_config
    from cluster.serve import start_deployment

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


MODES = ("kill", "drain")
DRAIN_SETTLE_S = 1.0  # RayActuator's default: routers hear "draining" before the worker refuses work
DRAIN_GRACE_S = 60.0  # what migration cannot move in time finishes within this, then is resumed


def _stall(s: dict, t0: float) -> tuple[float, int]:
    """(the stream's longest wait for a token after t0, counting from t0; tokens it had before t0)."""
    after = [t for t in s["times"] if t >= t0]
    marks = [t0, *after] if after else [t0, s["end"]]
    return max(b - a for a, b in zip(marks, marks[1:])), len(s["times"]) - len(after)


async def _lose_node(cluster: Any, d: Any, mode: str, victim: str, node: str) -> tuple[str, float | None]:
    """Take ``victim``'s node away by ``mode``; (the worker id that makes the pool whole, drain_s)."""
    if mode == "kill":
        await asyncio.to_thread(cluster.remove, node)
        return victim, None
    from cluster.ray_actuator import RayActuator

    t0 = time.monotonic()
    d.controller.retire(victim, drain_grace_s=DRAIN_GRACE_S, drain_settle_s=DRAIN_SETTLE_S)
    while any(r["worker_id"] == victim for r in d.controller.describe()):
        assert time.monotonic() - t0 < DRAIN_GRACE_S + 60, f"{victim} not released within {DRAIN_GRACE_S + 60} s"
        await asyncio.sleep(0.05)
    drain_s = time.monotonic() - t0
    await asyncio.to_thread(cluster.remove, node)
    before = {r["worker_id"] for r in d.controller.describe()}
    actuator = RayActuator(d.pools, d.controller, drain_grace_s=DRAIN_GRACE_S, drain_settle_s=DRAIN_SETTLE_S)
    await asyncio.to_thread(actuator.scale_to, d.pools[0].name, 2)
    added = [r["worker_id"] for r in d.controller.describe() if r["worker_id"] not in before]
    assert len(added) == 1, f"scale_to added {added}"
    return added[0], drain_s


async def _one_run(cluster: Any, d: Any, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    stop, streams = asyncio.Event(), []
    clients = [asyncio.ensure_future(_client(d.address, args.tokens, stop, streams)) for _ in range(args.clients)]
    await asyncio.sleep(args.warmup)
    victim = _busiest(d)
    pool = d.pools[0]
    node = cluster.name_of(pool.bundle_nodes(pool.replica(victim))[0])
    counts0 = d.router.stats()["requests"]
    in_flight = [s for s in streams if "end" not in s]
    restarts = d.controller.num_restarts
    t0 = time.monotonic()
    lose = asyncio.ensure_future(_lose_node(cluster, d, mode, victim, node))
    full_at, drain_s, back = None, None, victim
    while full_at is None or any("end" not in s for s in in_flight):
        if lose is not None and lose.done():
            back, drain_s = lose.result()
            lose = None
        # whole again: two members, one of them the restarted (kill) or added (drain) worker, serving
        if full_at is None and lose is None and len(d.controller.members()) == 2 and (
                d.controller.num_restarts > restarts if mode == "kill" else back in dict(d.controller.members())):
            full_at = time.monotonic()
        assert time.monotonic() - t0 < 300, f"{mode}: no recovery within 300 s"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*clients)
    counts = d.router.stats()["requests"]
    resumed, migrated = (counts.get(k, 0) - counts0.get(k, 0) for k in ("resumed", "migrated"))
    # (stall, tokens before t0) of each stream in flight at t0, longest stall first: the router's
    # resumed + migrated count of them are the lost worker's streams
    stalls = sorted((_stall(s, t0) for s in in_flight), reverse=True)
    n_affected = min(resumed + migrated, len(stalls))
    affected = stalls[:n_affected]
    out = {"mode": mode, "node": node, "worker": victim, "in_flight": len(in_flight), "affected": n_affected,
           "resume_s": max((w for w, _ in affected), default=0.0),
           "resume_median_s": statistics.median(w for w, _ in affected) if affected else 0.0,
           "unaffected_max_gap_s": max((w for w, _ in stalls[n_affected:]), default=0.0),
           "pool_full_s": full_at - t0,
           "tokens_recomputed": sum(PROMPT_TOKENS + n for _, n in affected[:resumed]),
           "migrated": migrated, "resumed": resumed,
           "lost": sum(1 for s in streams if s["error"]), "errors": sorted({s["error"] for s in streams if s["error"]})}
    if drain_s is not None:
        out["drain_s"] = drain_s
    return out


KEYS = ("affected", "resume_s", "resume_median_s", "unaffected_max_gap_s", "pool_full_s", "tokens_recomputed",
        "migrated", "resumed", "lost")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2)")
    p.add_argument("--mode", choices=("kill", "drain", "both"), default="both",
                   help="kill the busiest worker's node, drain it (live migration) then remove it, or both, "
                        "alternating (default both)")
    p.add_argument("--runs", type=int, default=3, help="runs per mode")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=192,
                   help="output tokens per request (192: streams outlive the drain's settle time, so some migrate)")
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name in ("runs", "clients", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    modes = MODES if args.mode == "both" else (args.mode,)
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import ray

    from testkit.multinode import LocalCluster
    from workers.models.assets import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    cluster = LocalCluster()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for name in "abc":
            cluster.add(name, 2, {MAIN: 1000})
        d = _deploy(cluster, model, "duet_node_loss")
        try:
            for _ in range(args.runs):
                for mode in modes:
                    runs[mode].append(asyncio.run(_one_run(cluster, d, args, mode)))
                    print(json.dumps(runs[mode][-1]), flush=True)
                    cluster.restore()  # a replacement node: the spare for the next run
        finally:
            d.stop()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "model": model, "clients": args.clients,
                              "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS, "warmup_s": args.warmup,
                              "drain_settle_s": DRAIN_SETTLE_S, "modes": {}}
    for mode in modes:
        summary = {k: statistics.median(r[k] for r in runs[mode]) for k in KEYS}
        if mode == "drain":
            summary["drain_s"] = statistics.median(r["drain_s"] for r in runs[mode])
        result["modes"][mode] = {"runs": runs[mode], "median": summary}
        print(f"{mode}: median over {len(runs[mode])} runs:", json.dumps(summary), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
