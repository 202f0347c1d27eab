"""`duet bench`: Poisson load over gRPC or the OpenAI HTTP API, serving latency percentiles, goodput,
and router overhead.

Two ways to run it:

    duet bench                               # self-hosted: start a 1-worker deployment (embedded Ray,
                                             # SmolLM2), measure router vs direct-to-worker, stop it
    duet bench --target HOST:PORT [--worker-endpoint HOST:PORT] [--http-target HOST:PORT]
                                             # an already running router (and optionally one of its
                                             # workers' internal endpoints for the overhead columns,
                                             # and its HTTP API for the api phase / --api openai)

``--api grpc|openai`` picks the API the router path of the overhead and rates phases drives (the
same requests either way; cluster/bench/api.py has the HTTP sender).

Phases (each phase sends the same requests on both paths; metrics in cluster/bench/metrics.py,
workload and senders in cluster/bench/load_gen.py):
    overhead    closed loop, one request at a time, each request through the router and straight to
                the worker back to back (order alternating): the router's added TTFT and time per
                token, as medians of the per-request differences. Targets: < 1 ms TTFT, < 0.2 ms/token.
    rates       open loop: ``--num-requests`` requests arriving as a Poisson process at each rate of
                ``--rates`` (req/s; 'inf' = all at once), through the router and (if a worker endpoint
                is known) straight to the worker: TTFT, TPOT, ITL, E2E p50/p90/p99, throughput, goodput,
                and the prefix hit rate per KV tier (device, host, disk) from the worker's counters
                (cluster/bench/tier_hits.py; needs the worker endpoint).
    echo        the overhead phase again, ``--echo-overhead-requests`` pairs, against a zero-compute
                worker (cluster/bench/echo_worker.py, its own process) behind a router in this process:
                without the engine's ±10 ms step jitter the router's sub-millisecond cost is resolved
                precisely. Runs in both modes (it starts its own router and echo worker).
    api         the same requests over gRPC and over the OpenAI HTTP API of the same router, one at a
                time, back to back: HTTP's added TTFT and time per token (cluster/bench/api.py),
                against the real worker and, in the echo phase, the echo worker. Targets: < 1 ms
                TTFT, < 0.1 ms per token.
    n           one sample vs n=4 samples of a ~500-token prompt (fresh prompts per trial): E2E
                ratio. Target < 2x (the prompt is computed once).

Writes JSON (every summary plus the raw per-request timings) to ``--out`` (default
``duet-bench/serving_bench.json`` under the current directory) and, when matplotlib is installed, a
PNG plot next to it (cluster/bench/report.py). A router started with TLS or bearer tokens is
measured with ``--tls`` / ``--tls-ca`` / ``--tls-cert`` + ``--tls-key`` / ``--token`` (the same flags
as ``duet generate``); the direct-to-worker path is the internal, plaintext endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from protos.duet.worker.v1 import worker_pb2_grpc
from cluster.bench.api import (OpenAISender, http_client, long_prompts, measure_api_overhead, measure_n_fanout,
                               print_api_report)
from cluster.bench.load_gen import (BenchRequest, RouterSender, Sender, WorkerSender, build_workload,
                                 poisson_arrivals, run_alternating, run_open_loop)
from cluster.bench.metrics import SLO, percentile, summarize
from cluster.bench.tier_hits import hit_rates, read_counters
from cluster.bench.report import (PLOT_HINT, TARGET_PER_TOKEN_OVERHEAD_MS, TARGET_TTFT_OVERHEAD_MS, code_version,
                                  machine, plot, print_report)

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path("duet-bench") / "serving_bench.json"  # relative: under the current directory


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="router host:port; unset = start a 1-worker deployment here")
    p.add_argument("--worker-endpoint", default=None,
                   help="one worker's internal host:port, for the direct (router overhead) columns; found "
                   "automatically when self-hosted")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="the API the router path drives in the overhead and rates phases (default grpc)")
    p.add_argument("--http-target", default=None, help="the router's HTTP API host:port (needed for --api openai "
                   "and the api phase against --target; found automatically when self-hosted)")
    p.add_argument("--api-compare-requests", type=int, default=24,
                   help="request pairs (gRPC, HTTP) in the api phase, 0 = skip (default 24)")
    p.add_argument("--n-trials", type=int, default=4, help="n=1 vs n=4 trials on long prompts, 0 = skip (default 4)")
    p.add_argument("--n-max-tokens", type=int, default=32, help="tokens per choice in the n phase (default 32)")
    p.add_argument("--n-prompt-tokens", type=int, default=500, help="prompt length in the n phase (default 500)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="model name or checkpoint dir (tokenizer for the workload; served when self-hosted)")
    p.add_argument("--rates", default="1,2,4,inf", help="Poisson request rates in req/s, comma-separated; "
                   "'inf' sends all at once (default 1,2,4,inf)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate and path (default 32)")
    p.add_argument("--min-output", type=int, default=16, help="shortest output in tokens (default 16)")
    p.add_argument("--max-output", type=int, default=64, help="longest output in tokens (default 64)")
    p.add_argument("--overhead-requests", type=int, default=24,
                   help="requests per path in the closed-loop overhead phase, 0 = skip (default 24)")
    p.add_argument("--echo-overhead-requests", type=int, default=200,
                   help="pairs in the overhead phase against a zero-compute echo worker, 0 = skip (default 200)")
    p.add_argument("--overhead-only", action="store_true", help=argparse.SUPPRESS)  # the echo phase's child run
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on TTFT (default 1000)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput SLO on TPOT (default 100)")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on E2E (default: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline in seconds")
    p.add_argument("--cpus-per-replica", type=int, default=None, help="self-hosted worker CPUs (default: config)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="self-hosted: turn the worker's prefix cache off (every path and rate sends the same "
                        "prompts, so with it on, all but the first pass hit the cache)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON path (default ./{DEFAULT_OUT}); the PNG "
                   "goes next to it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (drawn only when matplotlib is installed)")
    from cluster.client_args import add_client_security  # the same flags as `duet generate`

    add_client_security(p)
    p.add_argument("--quick", action="store_true", help="smoke run: rates 2,inf, 8 requests, 6 overhead pairs, 40 echo pairs")
    return p


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            rate = float("inf") if part == "inf" else float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number or 'inf'") from None
        if not rate > 0:
            raise ValueError(f"--rates: {part!r} must be > 0")
        rates.append(rate)
    return rates


# ------------------------------------------------------------------ phases
async def measure_overhead(senders: list[Sender], requests: list[BenchRequest]) -> dict[str, Any]:
    """Closed-loop pairs: per-request router - direct differences of TTFT and TPOT (medians)."""
    await run_alternating(senders, requests[:2])  # warm-up: channels, caches, first-call costs
    runs = await run_alternating(senders, requests)
    router, direct = runs["router"], runs["direct"]
    pairs = [(r, d) for r, d in zip(router, direct) if r.ok and d.ok]
    ttft = [(r.ttft - d.ttft) * 1e3 for r, d in pairs]
    tpot = [(r.tpot - d.tpot) * 1e3 for r, d in pairs if r.tpot is not None and d.tpot is not None]
    out: dict[str, Any] = {
        "pairs": len(pairs),
        "ttft_overhead_p50_ms": statistics.median(ttft) if ttft else math.nan,
        "per_token_overhead_p50_ms": statistics.median(tpot) if tpot else math.nan,
        # Spread of the paired differences: when it is wide compared with the targets, the machine
        # was too noisy for the medians to settle the targets (rerun on a quiet machine).
        "ttft_overhead_p25_p75_ms": _quartiles(ttft),
        "per_token_overhead_p25_p75_ms": _quartiles(tpot),
        "router_ttft_p50_ms": statistics.median(r.ttft * 1e3 for r, _ in pairs) if pairs else math.nan,
        "direct_ttft_p50_ms": statistics.median(d.ttft * 1e3 for _, d in pairs) if pairs else math.nan,
        "router_tpot_p50_ms": statistics.median(r.tpot * 1e3 for r, _ in pairs if r.tpot) if pairs else math.nan,
        "direct_tpot_p50_ms": statistics.median(d.tpot * 1e3 for _, d in pairs if d.tpot) if pairs else math.nan,
        "raw": {name: [asdict(r) for r in recs] for name, recs in runs.items()},
    }
    out["ttft_target_met"] = out["ttft_overhead_p50_ms"] < TARGET_TTFT_OVERHEAD_MS
    out["per_token_target_met"] = out["per_token_overhead_p50_ms"] < TARGET_PER_TOKEN_OVERHEAD_MS
    return out


async def measure_rates(senders: list[Sender], requests: list[BenchRequest], rates: list[float], seed: int,
                        slo: SLO, worker: Any = None) -> list[dict[str, Any]]:
    """worker: the worker's WorkerStub, read before and after each run for its hit rate per tier."""
    results = []
    prompt_lengths = [len(r.prompt_ids) for r in requests]
    for i, rate in enumerate(rates):
        arrivals = poisson_arrivals(len(requests), rate, seed + i)
        order = senders if i % 2 == 0 else senders[::-1]
        for sender in order:
            before = await read_counters(worker) if worker is not None else None
            records = await run_open_loop(sender, requests, arrivals)
            summary = summarize(records, slo)
            if before is not None:
                summary["hit_rate"] = hit_rates(before, await read_counters(worker), prompt_lengths)
            summary.update(path=sender.name, rate=_rate_json(rate), raw=[asdict(r) for r in records])
            results.append(summary)
            logger.info("rate %s %-6s: %d/%d ok, TTFT p50 %.1f ms, TPOT p50 %.2f ms, %.1f out tok/s, goodput %.2f req/s",
                        _rate_json(rate), sender.name, summary["completed"], summary["num_requests"],
                        summary["ttft"]["p50_ms"], summary["tpot"]["p50_ms"], summary["output_throughput_tps"],
                        summary["goodput_rps"])
    return results


async def run_phases(args: argparse.Namespace, target: str, worker_endpoint: str | None,
                     requests: list[BenchRequest], rates: list[float], slo: SLO) -> dict[str, Any]:
    from cluster.client_args import client_security
    from router.client import open_channel

    tls, token = client_security(args)
    if args.api == "openai" and not args.http_target:
        raise ValueError("--api openai needs --http-target (the router's HTTP API host:port)")
    channels = [open_channel(target, tls=tls, retries=0)]  # a rejection is a measured error, not retried
    http = http_client(args.http_target, args.timeout, tls, token) if args.http_target else None
    senders: list[Sender] = [OpenAISender(http, args.timeout, name="router") if http is not None and args.api == "openai"
                             else RouterSender(channels[0], args.timeout, token)]
    if worker_endpoint:
        channels.append(grpc.aio.insecure_channel(worker_endpoint))
        senders.append(WorkerSender(channels[1], args.timeout))
    try:
        out: dict[str, Any] = {}
        if worker_endpoint and args.overhead_requests > 0:
            logger.info("overhead phase: %d requests per path, one at a time", args.overhead_requests)
            out["overhead"] = await measure_overhead(senders, requests[:args.overhead_requests])
        if args.http_target and args.api_compare_requests > 0:
            logger.info("api phase: %d requests over gRPC and over HTTP, one at a time", args.api_compare_requests)
            out["api_overhead"] = await measure_api_overhead(target, args.http_target,
                                                             requests[:args.api_compare_requests], args.timeout,
                                                             tls, token)
        if not args.overhead_only:
            worker = worker_pb2_grpc.WorkerStub(channels[1]) if worker_endpoint else None
            out["rates"] = await measure_rates(senders, requests[:args.num_requests], rates, args.seed, slo, worker)
            if args.n_trials > 0:
                logger.info("n phase: %d trials of n=1 vs n=4 on %d-token prompts", args.n_trials, args.n_prompt_tokens)
                out["n_fanout"] = await measure_n_fanout(
                    target, long_prompts(_tokenizer(args.model), 2 * args.n_trials + 2, args.n_prompt_tokens),
                    args.n_max_tokens, args.timeout, prompt_tokens=args.n_prompt_tokens, tls=tls, token=token)
        return out
    finally:
        for ch in channels:
            await ch.close()
        if http is not None:
            await http.aclose()


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from workers.models.assets.resolve import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def _quartiles(values: list[float]) -> list[float]:
    return [percentile(values, 25), percentile(values, 75)]


def _rate_json(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate


# ------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from workers.models.assets.resolve import resolve_model

    if args.quick:
        args.rates, args.num_requests, args.overhead_requests = "2,inf", 8, min(args.overhead_requests, 6)
        args.echo_overhead_requests = min(args.echo_overhead_requests, 40)
    rates = parse_rates(args.rates)
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.overhead_requests < 0 or args.echo_overhead_requests < 0:
        raise ValueError("--overhead-requests and --echo-overhead-requests must be >= 0")
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if args.api_compare_requests < 0 or args.n_trials < 0 or args.n_max_tokens < 1 or args.n_prompt_tokens < 1:
        raise ValueError("--api-compare-requests and --n-trials must be >= 0, --n-max-tokens and --n-prompt-tokens "
                         ">= 1")
    n = max(args.num_requests, args.overhead_requests, args.echo_overhead_requests, args.api_compare_requests)
    requests = build_workload(tokenizer, n, seed=args.seed, min_output=args.min_output, max_output=args.max_output)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, None if args.slo_e2e_ms is None else args.slo_e2e_ms / 1e3)
    res: dict[str, Any] = {
        "config": {"model": args.model, "num_requests": args.num_requests, "rates": [_rate_json(r) for r in rates],
                   "min_output": args.min_output, "max_output": args.max_output, "seed": args.seed,
                   "overhead_requests": args.overhead_requests,
                   "echo_overhead_requests": args.echo_overhead_requests, "slo_ttft_ms": args.slo_ttft_ms,
                   "slo_tpot_ms": args.slo_tpot_ms, "slo_e2e_ms": args.slo_e2e_ms, "api": args.api,
                   "api_compare_requests": args.api_compare_requests, "n_trials": args.n_trials,
                   "self_hosted": args.target is None},
        "machine": machine(), "code": code_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.target is not None:
        res.update(asyncio.run(run_phases(args, args.target, args.worker_endpoint, requests, rates, slo)))
    else:
        from cluster.config.duet import load_config
        from cluster.deploy.serve import start_deployment

        overrides = {"model.name": args.model, "router.port": 0, "router.http_port": _free_port(),
                     "controller.port": 0, "pool.replicas": 1,
                     "pool.cpus_per_replica": args.cpus_per_replica,
                     "pool.engine.enable_prefix_caching": False if args.no_prefix_caching else None}
        config = load_config(None, overrides=overrides, env={})
        with start_deployment(config, log_to_driver=False) as d:
            assert d.controller is not None  # start_deployment returns a deployment that is up
            res["config"]["deployment"] = config.to_dict()
            res.update(_load_from_subprocess(args, d.address, d.controller.members()[0][1],
                                             http_target=d.router.http_address))
    if args.echo_overhead_requests > 0 and not args.overhead_only:
        res["overhead_echo"] = measure_echo_overhead(args, model_path)
        if "api" in res["overhead_echo"]:
            res["api_overhead_echo"] = res["overhead_echo"].pop("api")
    return res


def _load_from_subprocess(args: argparse.Namespace, target: str, worker_endpoint: str, *,
                          overhead_requests: int | None = None, overhead_only: bool = False,
                          http_target: str | None = None) -> dict[str, Any]:
    """Run the load phases in a child process: a client sharing the router's process (and its GIL)
    would slow the router path it measures."""
    import tempfile

    n_overhead = args.overhead_requests if overhead_requests is None else overhead_requests
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "phases.json"
        cmd = [sys.executable, "-m", "cluster.bench.serving", "--target", target, "--worker-endpoint",
               worker_endpoint, "--model", args.model, "--rates", args.rates, "--num-requests", str(args.num_requests),
               "--min-output", str(args.min_output), "--max-output", str(args.max_output), "--overhead-requests",
               str(n_overhead), "--echo-overhead-requests", "0", "--seed", str(args.seed),
               "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
               "--timeout", str(args.timeout), "--out", str(out), "--no-plot", "--api", args.api,
               "--api-compare-requests", str(args.api_compare_requests), "--n-trials", str(args.n_trials),
               "--n-max-tokens", str(args.n_max_tokens), "--n-prompt-tokens", str(args.n_prompt_tokens)]
        if http_target or args.http_target:
            cmd += ["--http-target", http_target or args.http_target]
        if args.slo_e2e_ms is not None:
            cmd += ["--slo-e2e-ms", str(args.slo_e2e_ms)]
        if overhead_only:
            cmd.append("--overhead-only")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)  # its logs stay on stderr
        child = json.loads(out.read_text())
    return {k: child[k] for k in ("overhead", "rates", "api_overhead", "n_fanout") if k in child}


ECHO_GAP_MS = 1.0  # the echo worker's pace between streamed ids


def measure_echo_overhead(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    """The overhead phase against a zero-compute worker: the echo worker in its own process (as a
    real worker is), a router on a thread of this process (as ``duet serve`` runs it), the load
    generator in a child process. Returns the overhead summary plus the echo settings."""
    from router.config import RouterConfig
    from router.server import serve_router

    proc = subprocess.Popen([sys.executable, "-m", "cluster.bench.echo_worker", "--port", "0",
                             "--gap-ms", str(ECHO_GAP_MS)], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = f"127.0.0.1:{_read_echo_port(proc)}"
        config = RouterConfig(tokenizer_path=str(model_path), port=0, http_port=_free_port())  # default policy, limits
        with serve_router(config, [("echo", endpoint)]) as router:
            _wait_serving(router.address)
            logger.info("echo phase: %d requests per path against a zero-compute worker at %s",
                        args.echo_overhead_requests, endpoint)
            res = _load_from_subprocess(args, router.address, endpoint, overhead_requests=args.echo_overhead_requests,
                                        overhead_only=True, http_target=router.http_address)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if "api_overhead" in res:
        res["overhead"]["api"] = res["api_overhead"]
    return {**res["overhead"], "echo_gap_ms": ECHO_GAP_MS, "policy": config.policy}


def _read_echo_port(proc: subprocess.Popen[str], timeout: float = 60.0) -> int:
    import select

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("ECHO_WORKER_PORT="):
                return int(line.split("=", 1)[1])
            if not line and proc.poll() is not None:
                break
    raise RuntimeError(f"the echo worker did not start (exit code {proc.poll()}); see its log above")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(address: str, timeout: float = 30.0) -> None:
    """Block until the router reports SERVING (it has polled the worker once)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"the router at {address} did not become SERVING within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the HTTP sender
    try:
        res = run(args)
    except ValueError as e:
        print(f"duet bench: error: {e}", file=sys.stderr)
        return 2
    print_report(res)
    print_api_report(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(f"\nwrote {args.out}")
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        print(f"wrote {png}" if plot(res, png) else PLOT_HINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
