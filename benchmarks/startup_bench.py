"""How long a replica takes from "start one" to its first served token, by phase, and what a second
replica on the node costs in memory.

    python -m benchmarks.startup_bench                       # SmolLM2 on CPU, every scenario, 3 repeats
    python -m benchmarks.startup_bench --quantization q4     # the GGUF-sourced 4-bit model
    python -m benchmarks.startup_bench --scenarios warm --repeats 1   # one quick run (the test's)
    python -m benchmarks.startup_bench --cluster             # also through duet serve: wake from zero
    python -m benchmarks.startup_bench --cluster --scenarios '' --no-memory   # only through duet serve

Each start runs in a fresh Python process (what a new Ray worker process is), launched by this
script at time t0; the process imports, resolves the model, loads and serves it exactly as a
worker actor does (workers/server/actor.py: ``rank_config``, ``start_worker_server``), then
answers one greedy request over gRPC. Its ``StartupTimeline`` (workers/startup.py) is anchored at
t0 (CLOCK_MONOTONIC is one clock for the host), so its phases are:

    schedule     process start + imports (what Ray's worker process start pays; placement on a
                 Ray cluster comes on top, measured by the cluster path of tests/e2e)
    resolve, config, kernels, weights, kv, tokenizer, warm_up, serve   as in workers/startup.py
    first_token  one greedy request's first token over gRPC, sent as soon as the server listens

``wall_s`` is measured here, independently: from t0 until this script reads the first-token line
from the process's output; ``unaccounted_s`` = wall - the sum of the phases (the pipe's latency).
There is no registration phase: no controller or router runs here.

Scenarios (each a fresh process):
    cold       no shared snapshot; the checkpoint's files and the kernels' library dropped from the
               page cache first (posix_fadvise DONTNEED), so the weights come from disk
    warm       no shared snapshot; files in the page cache (a restart on the same node)
    publish    shared_weights_dir empty: load, then write the node's snapshot and map it (the first
               replica of a node with sharing on)
    shared     shared_weights_dir holds the snapshot: the weights are mapped (a second replica)
    standby    a standby replica (loaded with the snapshot, warmed up once, no KV, no engine)
               promoted: phases from the promotion call (kv, serve, first_token); its load is
               reported beside
    prestarted a warm worker process (a standby with ``standby_load: process``: imports done, the
               model's config and tokenizer read, kernels loaded, no weights; workers/build.py
               ``prewarm``) started at t0 by this script's go over its stdin: the whole load in
               that process (config, kernels, weights mapped from the snapshot, kv, warm_up,
               serve, first_token); its preparation is reported beside

Cluster path (``--cluster``): a real ``duet serve`` deployment (embedded Ray, controller,
membership service, router in this process; one pool, ``shared_weights_dir`` set) whose pool is
scaled to zero; then one greedy request is sent to the router at t0. The router holds it, asks
the controller to wake the pool (cluster/deploy/wake.py), the new replica starts (or a standby is
promoted), joins, and serves the held request. Phases, from t0:

    wake         router hold -> the controller's scale-up decision (PoolWaker)
    schedule     placement group, Ray worker process start, imports, up to the actor's __init__
    resolve ... serve   the actor's own timeline (a promotion: kv, serve only)
    register     the worker serving -> the controller saw it up (its poll)
    first_token  controller -> membership push -> router health poll -> dispatch -> first token

``wall_s`` is the client's own time to the first token. Scenarios: ``cluster-cold`` (no snapshot,
files dropped from the page cache), ``cluster-shared`` (the node's snapshot is mapped),
``cluster-standby`` (the pool keeps one standby replica; the wake promotes it) and
``cluster-prestarted`` (a second deployment whose pool has ``standby_load: process``: the wake
promotes a warm worker process, which maps the node's snapshot).

Memory: two replicas serving at once, with the snapshot (shared) and without (private): each
process's Rss and Pss from /proc/<pid>/smaps_rollup (Pss charges a page shared by k processes 1/k
to each), the node's total Pss, and the snapshot's size. Also, for each in-process standby and
prestarted start, its process's Rss and Pss once prepared (what it holds while it waits).

Writes benchmarks/results/startup_bench.json: per scenario the runs, the median of each phase and
of wall_s; ratios shared / cold and standby / cold; the memory table. Run it alone (the machine is
shared: ``flock /tmp/duet-heavy.lock``) and note the load (``uptime``) with the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "startup_bench.json"
SCENARIOS = ("cold", "warm", "publish", "shared", "standby", "prestarted")
NEEDS_SNAPSHOT = ("shared", "standby", "prestarted")
PROMPT = [1, 504, 3575, 282, 4649, 314]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- the child process
def child(args: argparse.Namespace) -> None:
    """One replica start, in this fresh process (module docstring); prints JSON lines."""
    import asyncio

    from workers.startup import StartupTimeline

    timeline = StartupTimeline.start(args.origin)
    import grpc
    import torch

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
    from workers.build import build_engine, preload, prewarm
    from workers.config import CacheConfig, EngineConfig
    from workers.server.actor import rank_config
    from workers.server.service import start_worker_server

    timeline.mark("schedule")
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, quantization=args.quantization, shared_weights_dir=args.shared_dir,
                          cache=CacheConfig(kv_cache_memory_bytes=args.kv_bytes))

    async def run() -> None:
        nonlocal timeline
        cfg = await asyncio.to_thread(rank_config, config, 0.0)
        timeline.mark("resolve")
        make_engine, prepared, prepared_memory = None, None, None
        if args.prestart:  # a warm worker process: prepared now, started when the parent says go (at t0)
            tokenizer = await asyncio.to_thread(prewarm, cfg, timeline)
            prepared_memory = rollup(os.getpid())
            print(json.dumps({"prestarted": True}), flush=True)
            origin = float(await asyncio.to_thread(sys.stdin.readline))
            prepared, timeline = timeline, StartupTimeline.start(origin)

            def make_engine():
                return build_engine(cfg, tokenizer=tokenizer, timeline=timeline)
        elif args.standby:
            def prepare():
                pre = preload(cfg, timeline)
                pre.warm_up(cfg, timeline)
                return pre
            pre = await asyncio.to_thread(prepare)
            prepared_memory = rollup(os.getpid())
            prepared, timeline = timeline, StartupTimeline.start()  # the promotion starts now

            def make_engine():
                return build_engine(cfg, runner=pre.runner(cfg, timeline), tokenizer=pre.tokenizer, timeline=timeline)
        server = await start_worker_server(cfg, "127.0.0.1", 0, "bench-0", num_threads=args.threads,
                                           make_engine=make_engine, timeline=timeline, warm_up=not args.standby)
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = worker_pb2.SubmitRequest(request_id="first", prompt_token_ids=PROMPT, sampling=worker_pb2.SamplingParams(
                max_tokens=args.max_tokens, temperature=0, top_p=1, ignore_eos=True))
            tokens: list[int] = []
            async for msg in stub.Submit(request):
                if not tokens and msg.token_ids:
                    timeline.mark("first_token")
                    print(json.dumps({"first_token": True}), flush=True)
                tokens.extend(msg.token_ids)
        out = {"timeline": timeline.to_dict(), "tokens": tokens, "pid": os.getpid(), "origin_is_t0": not args.standby}
        if prepared is not None:
            assert prepared_memory is not None  # read when it was prepared
            out["prepare"] = prepared.to_dict()
            out["prepared_memory"] = {"rss": prepared_memory["Rss"], "pss": prepared_memory["Pss"]}
        print(json.dumps(out), flush=True)
        if args.hold:  # two replicas at once: measured by the parent, then released
            await asyncio.to_thread(sys.stdin.readline)
        await server.stop(grace=1)

    asyncio.run(run())


# ---------------------------------------------------------------------------------- the parent
def drop_page_cache(paths: list[Path]) -> None:
    """Evict these files from the page cache (clean pages; no root needed)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_files(model_path: Path) -> list[Path]:
    from kernels._build import build_dir
    from workers.models.checkpoint import gguf_source

    files = [p for p in model_path.iterdir() if p.is_file()]
    if (g := gguf_source(model_path)) is not None:
        files.append(g)
    return files + [p for p in build_dir().glob("*.so")]


def launch(args: argparse.Namespace, *, shared_dir: str | None, standby: bool, hold: bool = False,
           prestart: bool = False) -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "benchmarks.startup_bench", "--child", "--origin", repr(t0), "--model", args.model,
           "--quantization", args.quantization, "--threads", str(args.threads), "--kv-bytes", str(args.kv_bytes),
           "--max-tokens", str(args.max_tokens)]
    cmd += ["--shared-dir", shared_dir] if shared_dir else []
    cmd += ["--standby"] if standby else []
    cmd += ["--hold"] if hold else []
    cmd += ["--prestart"] if prestart else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    return proc, t0


def read_start(proc: subprocess.Popen, t0: float) -> dict[str, Any]:
    """The child's report; wall_s measured here, at the first-token line."""
    from workers.startup import StartupTimeline

    assert proc.stdout is not None  # launched with stdout=PIPE
    first = proc.stdout.readline()
    wall = time.monotonic() - t0
    if not first:
        raise RuntimeError(f"the replica process exited ({proc.wait()}) before its first token; see its stderr")
    report = json.loads(proc.stdout.readline())
    timeline = StartupTimeline.from_dict(report["timeline"])
    phases = timeline.phases()
    out = {"phases": dict(phases), "order": [p for p, _ in phases], "notes": timeline.notes,
           "wall_s": wall if report["origin_is_t0"] else None, "sum_phases_s": sum(d for _, d in phases),
           "tokens": report["tokens"], "pid": report["pid"]}
    if out["wall_s"] is not None:
        out["unaccounted_s"] = wall - out["sum_phases_s"]
    else:  # standby: the promotion's origin is inside the process; its wall is the phases' sum
        out["wall_s"] = out["sum_phases_s"]
    if "prepare" in report:
        prep = StartupTimeline.from_dict(report["prepare"])
        out["prepare"] = {"phases": dict(prep.phases()), "elapsed_s": prep.elapsed_s, "notes": prep.notes,
                          "memory": report["prepared_memory"]}  # Rss / Pss once prepared, before the start
    return out


def run_start(args: argparse.Namespace, scenario: str, node_dir: Path, model_path: Path) -> dict[str, Any]:
    snapshot = list(node_dir.glob("*.safetensors"))
    if scenario == "cold":
        drop_page_cache(cold_files(model_path))
    if scenario == "publish":
        for f in snapshot:
            f.unlink()
    shared = str(node_dir) if scenario in ("publish", *NEEDS_SNAPSHOT) else None
    proc, t0 = launch(args, shared_dir=shared, standby=scenario == "standby", prestart=scenario == "prestarted")
    try:
        if scenario == "prestarted":  # wait until it is warm, then say go: t0 is now
            assert proc.stdin is not None and proc.stdout is not None  # launched with PIPEs
            if not proc.stdout.readline():
                raise RuntimeError(f"the warm process exited ({proc.wait()}) before it was ready; see its stderr")
            t0 = time.monotonic()
            proc.stdin.write(f"{t0!r}\n")
            proc.stdin.flush()
        out = read_start(proc, t0)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def rollup(pid: int) -> dict[str, int]:
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines)}


def two_replicas(args: argparse.Namespace, shared_dir: str | None) -> dict[str, Any]:
    """Two replicas serving at once: each one's Rss / Pss and their tokens."""
    procs = []
    try:
        reports = []
        for _ in range(2):
            proc, t0 = launch(args, shared_dir=shared_dir, standby=False, hold=True)
            procs.append(proc)
            reports.append(read_start(proc, t0))
        mem = [rollup(r["pid"]) for r in reports]
        for proc in procs:
            assert proc.stdin is not None  # launched with stdin=PIPE
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {"replicas": [{"rss": m["Rss"], "pss": m["Pss"], "shared_clean": m.get("Shared_Clean", 0),
                          "weights": r["notes"].get("weights", "")} for m, r in zip(mem, reports)],
            "node_pss": sum(m["Pss"] for m in mem), "tokens_equal": reports[0]["tokens"] == reports[1]["tokens"],
            "tokens": reports[0]["tokens"]}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario, rs in runs.items():
        phases = {p: statistics.median(r["phases"].get(p, 0.0) for r in rs) for p in rs[0]["order"]}
        out[scenario] = {"wall_s_median": statistics.median(r["wall_s"] for r in rs), "phases_median": phases,
                         "weights": sorted({r["notes"].get("weights", "") for r in rs}), "repeats": len(rs)}
        if "prepare" in rs[0]:
            out[scenario]["prepare_s_median"] = statistics.median(r["prepare"]["elapsed_s"] for r in rs)
            if "memory" in rs[0]["prepare"]:  # in process: what a standby / warm process holds while it waits
                out[scenario]["prepared_rss_median"] = statistics.median(r["prepare"]["memory"]["rss"] for r in rs)
                out[scenario]["prepared_pss_median"] = statistics.median(r["prepare"]["memory"]["pss"] for r in rs)
    for prefix in ("", "cluster-"):
        cold = out.get(f"{prefix}cold", {}).get("wall_s_median")
        for scenario in ("shared", "standby", "prestarted", "warm", "publish"):
            if cold and f"{prefix}{scenario}" in out:
                out[f"{prefix}{scenario}"]["vs_cold"] = out[f"{prefix}{scenario}"]["wall_s_median"] / cold
    return out


# ---------------------------------------------------------------------------------- the cluster path
CLUSTER_SCENARIOS = ("cluster-cold", "cluster-shared", "cluster-standby", "cluster-prestarted")


def cluster_runs(args: argparse.Namespace, node_dir: Path, model_path: Path) -> dict[str, list[dict[str, Any]]]:
    """Every cluster scenario, ``args.repeats`` each: the first three through one deployment, the
    warm-process one through a second whose pool has ``standby_load: process``."""
    runs = deployment_runs(args, node_dir, model_path, CLUSTER_SCENARIOS[:3], "model")
    runs.update(deployment_runs(args, node_dir, model_path, CLUSTER_SCENARIOS[3:], "process"))
    return runs


def deployment_runs(args: argparse.Namespace, node_dir: Path, model_path: Path, scenarios: tuple[str, ...],
                    standby_load: str) -> dict[str, list[dict[str, Any]]]:
    """Wake-from-zero starts through a real deployment (module docstring), ``args.repeats`` each."""
    import grpc
    import ray

    from cluster.config.duet import load_config
    from cluster.deploy.serve import start_deployment
    from protos.duet.v1 import duet_pb2, duet_pb2_grpc
    from workers.startup import StartupTimeline

    config = load_config(env={}, overrides={
        "model.name": str(model_path), "model.quantization": args.quantization, "model.shared_weights_dir": str(node_dir),
        "pools[0].cpus_per_replica": args.threads, "pools[0].engine.kv_cache_memory_bytes": args.kv_bytes,
        "pools[0].standby_load": standby_load, "ray.num_cpus": 4, "router.port": 0, "router.http_port": 0,
        "controller.port": 0})
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    with start_deployment(config, log_to_driver=False) as d:
        pool, controller, actuator = config.pools[0].name, d.controller, d.actuator
        assert controller is not None  # start_deployment started it

        def wait(predicate, what: str, timeout: float = 600.0) -> None:
            deadline = time.monotonic() + timeout
            while not predicate():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out waiting for {what}: {controller.describe()}")
                time.sleep(0.1)

        def one(scenario: str) -> dict[str, Any]:
            standby = scenario in ("cluster-standby", "cluster-prestarted")
            controller.set_standby(pool, 1 if standby else 0)
            wait(lambda: controller.pool_states()[pool]["standby"] == (1 if standby else 0)
                 and controller.pool_states()[pool]["preparing"] == 0, "the standby count")
            actuator.scale_to(pool, 0)
            wait(lambda: not controller.members() and not any(r["state"] == "draining" for r in controller.describe()),
                 "the pool at zero")
            if scenario == "cluster-cold":
                for f in node_dir.glob("*.safetensors"):
                    f.unlink()
                drop_page_cache(cold_files(model_path))
            request = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=PROMPT), sampling=duet_pb2.SamplingParams(
                max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
            tokens: list[int] = []
            with grpc.insecure_channel(d.address) as channel:
                t0 = time.monotonic()
                first = None
                for msg in duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=600):
                    if first is None and msg.token_ids:
                        first = time.monotonic()
                    tokens.extend(msg.token_ids)
            row = next(r for r in controller.describe() if r["state"] == "up")
            actor = ray.get_actor(str(row["worker_id"]), namespace=config.ray.namespace)
            report = cast("dict[str, Any]", ray.get(actor.startup.remote(), timeout=60))
            timeline = StartupTimeline.start(t0)
            timeline.mark("wake", at=d.waker.woken_at[pool])
            start = StartupTimeline.from_dict(report["start"])
            if not report["prepare"]:  # a new actor, scheduled and started cold (not a promoted standby or warm process)
                timeline.mark("schedule", at=report["init_at"])
            timeline.extend(start)
            timeline.mark("register", at=float(row["ready_at"]))
            timeline.mark("first_token", at=first)
            phases = timeline.phases()
            out = {"phases": dict(phases), "order": [p for p, _ in phases], "notes": timeline.notes,
                   "wall_s": first - t0, "sum_phases_s": sum(x for _, x in phases), "tokens": tokens,
                   "worker_id": row["worker_id"], "promoted": bool(report["prepare"])}
            out["unaccounted_s"] = out["wall_s"] - out["sum_phases_s"]
            if report["prepare"]:
                prep = StartupTimeline.from_dict(report["prepare"])
                out["prepare"] = {"phases": dict(prep.phases()), "elapsed_s": prep.elapsed_s, "notes": prep.notes}
            return out

        for i in range(args.repeats):
            for scenario in scenarios:
                r = one(scenario)
                runs[scenario].append(r)
                logger.info("%s #%d: %.2f s (%s)", scenario, i, r["wall_s"],
                            ", ".join(f"{p} {x:.2f}" for p, x in r["phases"].items()))
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quantization", default="none", choices=("none", "int8", "q4"))
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, of {', '.join(SCENARIOS)} ('' with --cluster: only the cluster path)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure two replicas' resident memory, shared vs private [on]")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica [1: one CPU, as a 1-CPU pool]")
    p.add_argument("--kv-bytes", type=int, default=256 << 20, help="KV cache per replica [256 MiB]")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--node-dir", type=Path, help="shared_weights_dir to use [a fresh temporary directory]")
    p.add_argument("--cluster", action="store_true",
                   help="also measure waking a pool from zero through a real duet serve deployment (embedded Ray)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--profile-out", type=Path, help="also add this model's cold / shared / standby medians to a "
                   "simulator start-up profile (cluster/sim/startup.py), e.g. cluster/sim/data/startup_profiles.json; "
                   "the cluster path's figures when --cluster ran, else the in-process ones")
    p.add_argument("--device", default="cpu", help="device label of the profile entry [cpu]")
    # the child process's own arguments (internal)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--origin", type=float, help=argparse.SUPPRESS)
    p.add_argument("--shared-dir", help=argparse.SUPPRESS)
    p.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prestart", action="store_true", help=argparse.SUPPRESS)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers.models.assets.resolve import resolve_model

    model_path = resolve_model(args.model)
    args.model = str(model_path)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if bad := [s for s in scenarios if s not in SCENARIOS]:
        raise SystemExit(f"--scenarios: unknown {bad}; choose from {', '.join(SCENARIOS)}")
    if not scenarios and not args.cluster:
        raise SystemExit("--scenarios '': nothing to run; name scenarios or add --cluster")
    tmp = tempfile.TemporaryDirectory(prefix="duet-startup-")
    node_dir = args.node_dir or Path(tmp.name)
    node_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    try:
        for i in range(args.repeats):
            for scenario in scenarios:  # interleaved: the machine's load drifts over the run
                if scenario in NEEDS_SNAPSHOT and not list(node_dir.glob("*.safetensors")):
                    run_start(args, "publish", node_dir, model_path)  # needs a snapshot to map
                r = run_start(args, scenario, node_dir, model_path)
                runs[scenario].append(r)
                logger.info("%s #%d: %.2f s (%s)", scenario, i, r["wall_s"],
                            ", ".join(f"{p} {d:.2f}" for p, d in r["phases"].items()))
        result: dict[str, Any] = {"model": args.model, "quantization": args.quantization, "threads": args.threads,
                                  "kv_bytes": args.kv_bytes, "load_avg": os.getloadavg(), "runs": runs,
                                  "summary": summarise(runs)}
        tokens = {s: {tuple(r["tokens"]) for r in rs} for s, rs in runs.items()}
        if args.cluster:
            cluster = cluster_runs(args, node_dir / "cluster", model_path)
            runs.update(cluster)
            result["summary"].update(summarise(cluster))
            tokens.update({s: {tuple(r["tokens"]) for r in rs} for s, rs in cluster.items()})
        result["tokens_identical"] = len(set().union(*tokens.values())) == 1
        if args.memory:
            if not list(node_dir.glob("*.safetensors")):
                run_start(args, "publish", node_dir, model_path)
            snap = next(node_dir.glob("*.safetensors"))
            result["memory"] = {"snapshot_bytes": snap.stat().st_size, "shared": two_replicas(args, str(node_dir)),
                                "private": two_replicas(args, None)}
        result["load_avg_after"] = os.getloadavg()
        return result
    finally:
        tmp.cleanup()


def print_table(res: dict[str, Any]) -> None:
    s = res["summary"]
    order = list(dict.fromkeys(p for v in s.values() for p in v["phases_median"]))
    print(f"{'scenario':9} {'wall s':>7} {'x cold':>7}  " + " ".join(f"{p[:10]:>10}" for p in order))
    for name, v in s.items():
        ratio = f"{v['vs_cold']:7.2f}" if "vs_cold" in v else f"{'-':>7}"
        print(f"{name:9} {v['wall_s_median']:7.2f} {ratio}  " + " ".join(
            f"{v['phases_median'].get(p, float('nan')):10.3f}" if p in v["phases_median"] else f"{'-':>10}"
            for p in order))
    for name, v in s.items():
        if "prepared_rss_median" in v:
            print(f"{name} while prepared: Rss {v['prepared_rss_median'] / 1e6:.0f} MB, Pss {v['prepared_pss_median'] / 1e6:.0f} MB")
    if "memory" in res:
        m = res["memory"]
        print(f"snapshot {m['snapshot_bytes'] / 1e6:.0f} MB; two replicas, node Pss: shared "
              f"{m['shared']['node_pss'] / 1e6:.0f} MB vs private {m['private']['node_pss'] / 1e6:.0f} MB")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        child(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = run(args)
    print_table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    if args.profile_out is not None:
        write_profile(res, args)
    return 0


def write_profile(res: dict[str, Any], args: argparse.Namespace) -> None:
    """The medians as a simulator start-up profile entry ``<model name>@<device>``."""
    from cluster.sim.startup import StartupModel, save_startup

    s = res["summary"]
    prefix = "cluster-" if "cluster-cold" in s else ""
    model = StartupModel(s[f"{prefix}cold"]["wall_s_median"], s[f"{prefix}shared"]["wall_s_median"],
                         s[f"{prefix}standby"]["wall_s_median"],
                         f"benchmarks/startup_bench.py ({'cluster path: duet serve, wake from zero' if prefix else 'in process'}"
                         f"), {time.strftime('%Y-%m-%d')}, load {res['load_avg'][0]:.1f}, median of "
                         f"{s[f'{prefix}cold']['repeats']}",
                         s[f"{prefix}prestarted"]["wall_s_median"] if f"{prefix}prestarted" in s else None)
    key = f"{Path(res['model']).name}{'-' + res['quantization'] if res['quantization'] != 'none' else ''}@{args.device}"
    save_startup(args.profile_out, key, model)
    print(f"wrote {key} to {args.profile_out}")


if __name__ == "__main__":
    sys.exit(main())
