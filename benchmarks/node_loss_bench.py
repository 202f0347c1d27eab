"""Recovery after losing a whole Ray node under steady load (a real multi-node Ray on this host).

    python -m benchmarks.node_loss_bench                  # SmolLM2, 3 runs (~3 min)
    python -m benchmarks.node_loss_bench --runs 1 --clients 2

Setup: tests/testkit/multinode.py's LocalCluster: a head without CPUs (this process: router,
controller) and worker nodes a, b, c of {CPU: 2, duet_pool_main: 1000}; ``duet serve`` joins it
(ray.address) with pool ``main`` of 2 replicas x 1 CPU, SPREAD on duet_pool_main (so c is the
spare with room). Load: ``--clients`` closed-loop clients, each streaming greedy requests of
``--tokens`` output tokens (ignore_eos) back to back. After ``--warmup`` s the node of the worker
with the most running requests is killed (raylet, object store and its actors, no grace), and the
run goes on until the pool is whole again and every stream in flight at the kill has finished.

Figures per run (then medians over ``--runs``, one deployment; a replacement for the killed node
joins between runs, so there is always a spare):
    affected            streams the lost worker was serving (the router's ``resumed`` count): of
                        the streams in flight at the kill, those that waited longest for their
                        next token
    resume_s            kill -> the last affected stream's first token after the kill (max)
    resume_median_s     the same, median over the affected streams
    unaffected_max_gap_s  the same for the other streams in flight (the surviving worker's)
    pool_full_s         kill -> the controller lists both replicas up again (Ray re-placed the
                        lost bundle on the spare node and the worker loaded and started)
    tokens_recomputed   sum over affected streams of (prompt + tokens streamed before the kill):
                        the prefill the resuming worker repeats (nothing of a lost node's KV survives)
    lost                streams that ended with an error (must be 0)
Node death is detected with the test cluster's health checks (every 0.5 s, dead after 3 misses;
multinode.SYSTEM_CONFIG); Ray's production default takes longer, which adds to resume_s.
"With live KV migration" ([migrate]) is not measured here: migration cannot save a lost node's KV;
it applies to a node drained on purpose, which this script does not do yet.
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


async def _one_run(cluster: Any, d: Any, args: argparse.Namespace) -> dict[str, Any]:
    stop, streams = asyncio.Event(), []
    clients = [asyncio.ensure_future(_client(d.address, args.tokens, stop, streams)) for _ in range(args.clients)]
    await asyncio.sleep(args.warmup)
    victim = _busiest(d)
    pool = d.pools[0]
    node = cluster.name_of(pool.bundle_nodes(pool.replica(victim))[0])
    resumed0 = d.router.stats()["requests"].get("resumed", 0)
    in_flight = [s for s in streams if "end" not in s]
    restarts = d.controller.num_restarts
    killed = time.monotonic()
    await asyncio.to_thread(cluster.remove, node)
    full_at = None
    while full_at is None or any("end" not in s for s in in_flight):
        # whole again: Ray restarted the lost worker (the controller saw it and started it) and it serves
        if full_at is None and d.controller.num_restarts > restarts and len(d.controller.members()) == 2:
            full_at = time.monotonic()
        assert time.monotonic() - killed < 300, "no recovery within 300 s"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*clients)
    resumed = d.router.stats()["requests"].get("resumed", 0) - resumed0
    # (seconds from the kill to the stream's next token, tokens it had before the kill), longest
    # wait first: the router's ``resumed`` count of them are the lost worker's streams
    waits = sorted(((next((t for t in s["times"] if t >= killed), s["end"]) - killed,
                     sum(1 for t in s["times"] if t < killed)) for s in in_flight), reverse=True)
    affected = waits[:resumed]
    return {"killed_node": node, "worker": victim, "in_flight": len(in_flight), "affected": len(affected),
            "resume_s": max((w for w, _ in affected), default=0.0),
            "resume_median_s": statistics.median(w for w, _ in affected) if affected else 0.0,
            "unaffected_max_gap_s": max((w for w, _ in waits[resumed:]), default=0.0),
            "pool_full_s": full_at - killed,
            "tokens_recomputed": sum(PROMPT_TOKENS + n for _, n in affected),
            "lost": sum(1 for s in streams if s["error"]), "errors": sorted({s["error"] for s in streams if s["error"]})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import ray

    from testkit.multinode import LocalCluster
    from workers.models.assets import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    cluster = LocalCluster()
    runs = []
    try:
        for name in "abc":
            cluster.add(name, 2, {MAIN: 1000})
        d = _deploy(cluster, model, "duet_node_loss")
        try:
            for _ in range(args.runs):
                runs.append(asyncio.run(_one_run(cluster, d, args)))
                print(json.dumps(runs[-1]), flush=True)
                cluster.restore()  # a replacement node: the spare for the next run
        finally:
            d.stop()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    keys = ("affected", "resume_s", "resume_median_s", "unaffected_max_gap_s", "pool_full_s", "tokens_recomputed",
            "lost")
    summary = {k: statistics.median(r[k] for r in runs) for k in keys}
    result = {"date": time.strftime("%Y-%m-%d"), "model": model, "clients": args.clients, "tokens": args.tokens,
              "prompt_tokens": PROMPT_TOKENS, "runs": runs, "median": summary,
              "with_migration": "not measured: [migrate] had not landed on main"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("median over", len(runs), "runs:", json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
