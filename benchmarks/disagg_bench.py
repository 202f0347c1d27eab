"""Disaggregated prefill/decode vs colocated serving, on the same cores, in one run.

    python -m benchmarks.disagg_bench [--quick] [--rates 0.5,1,2] [--num-requests 16]

Two deployments of SmolLM2 (embedded Ray, 2 CPUs), one after the other, the same requests:
    colocated   one pool, 2 workers x 1 CPU, least_loaded routing (each worker prefills and decodes)
    disagg      a prefill pool of 1 worker x 1 CPU + a decode pool of 1 worker x 1 CPU; every
                request (prompts are all above router.disagg_min_prompt_tokens) is prefilled on the
                prefill worker and its KV sent to the decode worker over gloo
Workload: distinct prompts of ``--min-prompt``..``--max-prompt`` tokens (512-1024 by default: long
enough for prefill to stall colocated decodes), built from cluster/bench/data/serving_prompts.txt and
new for every rate (so no rate is helped by the prefix cache of an earlier one), with
``--min-output``..``--max-output`` output tokens (64-128, ignore_eos), arriving as a Poisson
process at each rate (cluster/bench/load_gen.py), through the public router; the load runs in a child
process so the client does not share the router's GIL. Metrics (cluster/bench/metrics.py):
per rate TTFT and TPOT p50/p90, and goodput (requests/s meeting the SLO) under a TTFT SLO alone,
a tight TPOT SLO alone, and both.

KV transfer throughput: the decode worker's counters (bytes received / seconds in transfers, from
its LoadReport) against a plain in-process memory copy of a tensor of the mean transfer size.

Noise: before each rate the run waits (bounded) for a quiet machine with the QuietGate of
benchmarks/engine_throughput.py and records the load average; the machine's other tenants still
share the cores during a run, so compare the two configurations in the same run, not across runs.
Writes JSON to ``--out`` (default benchmarks/results/disagg_bench.json) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "disagg_bench.json"
KV_BYTES = 512 << 20

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--rates", default="0.25,0.5,1", help="Poisson rates in req/s, comma-separated")
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate and configuration")
    p.add_argument("--min-prompt", type=int, default=512)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0, help="TTFT SLO (default 4000 ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=60.0, help="the tight TPOT SLO (default 60 ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quiet-budget", type=float, default=60.0, help="seconds to spend waiting for a quiet machine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="reduced run: rates 0.5,1, 8 requests")
    # Child mode (internal): run the load against --target and write the records to --records.
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------ workload
def long_prompts(tokenizer: Any, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` distinct user messages of lo..hi tokens: serving prompts in a seeded order, cut to length."""
    from cluster.bench.load_gen import load_prompts

    base = load_prompts()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target, ids = rng.randint(lo, hi), list[int]()
        while len(ids) < target:
            ids += tokenizer.encode(rng.choice(base) + "\n", add_special_tokens=False)
        out.append(tokenizer.decode(ids[:target]))
    return out


# ------------------------------------------------------------------ child: the load
def run_client(args: argparse.Namespace) -> int:
    import grpc

    from cluster.bench.load_gen import BenchRequest, RouterSender, poisson_arrivals, run_open_loop

    spec = json.loads(args.workload.read_text())

    async def go() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(args.target) as channel:
            sender = RouterSender(channel, args.timeout)
            out = {}
            for i, rate in enumerate(spec["rates"]):
                requests = [BenchRequest(r["prompt"], tuple(r["ids"]), r["max_tokens"]) for r in spec["requests"][i]]
                records = await run_open_loop(sender, requests, poisson_arrivals(len(requests), rate, spec["seed"] + i))
                out[str(rate)] = [asdict(r) for r in records]
                logger.info("rate %g: %d/%d ok", rate, sum(r.ok for r in records), len(records))
        return out

    args.records.write_text(json.dumps(asyncio.run(go())))
    return 0


# ------------------------------------------------------------------ parent: deployments
def configs(model: str) -> dict[str, dict[str, Any]]:
    engine = {"kv_cache_memory_bytes": KV_BYTES}
    return {
        "colocated": {"pools": [{"name": "default", "role": "colocated", "replicas": 2, "cpus_per_replica": 1,
                                 "engine": engine}]},
        "disagg": {"pools": [{"name": "prefill", "role": "prefill", "replicas": 1, "cpus_per_replica": 1,
                              "engine": engine},
                             {"name": "decode", "role": "decode", "replicas": 1, "cpus_per_replica": 1,
                              "engine": engine}]},
    }


def run_configuration(name: str, pools: dict[str, Any], args: argparse.Namespace, workload: Path,
                      rates: list[float]) -> dict[str, Any]:
    import yaml

    from benchmarks.engine_throughput import QuietGate
    from cluster.config.duet import load_config
    from cluster.deploy.serve import start_deployment

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "duet.yaml"
        path.write_text(yaml.safe_dump(pools))
        config = load_config(path, env={}, overrides={
            "model.name": args.model, "router.port": 0, "controller.port": 0, "router.policy": "least_loaded",
            "router.disagg_min_prompt_tokens": 256, "ray.num_cpus": 2, "ray.namespace": f"duet_bench_{name}"})
        with start_deployment(config, log_to_driver=False) as d:
            gate = QuietGate(args.quiet_budget)
            gate.wait()
            load_before = os.getloadavg()
            records = Path(tmp) / "records.json"
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "benchmarks.disagg_bench", "--target", d.address, "--workload",
                            str(workload), "--records", str(records), "--timeout", str(args.timeout)],
                           check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
            return {"records": json.loads(records.read_text()), "loads": worker_loads(d),
                    "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                    "seconds": time.monotonic() - started, "quiet_wait_s": gate.spent_s}


def worker_loads(d: Any) -> dict[str, dict[str, Any]]:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for worker_id, endpoint in d.controller.members():
        with grpc.insecure_channel(endpoint) as channel:
            report = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        out[worker_id] = MessageToDict(report, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return out


def memcpy_mb_s(nbytes: int, repeats: int = 21) -> float:
    """A plain memory copy of ``nbytes`` (float32 tensor -> preallocated tensor): median MB/s."""
    import torch

    src = torch.randn(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e6


def summarize_configuration(raw: dict[str, Any], rates: list[float], args: argparse.Namespace) -> list[dict[str, Any]]:
    from cluster.bench.metrics import SLO, RequestRecord, summarize

    slos = {"both": SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3), "ttft": SLO(args.slo_ttft_ms / 1e3),
            "tpot": SLO(tpot_s=args.slo_tpot_ms / 1e3)}
    rows = []
    for rate in rates:
        records = [RequestRecord(**r) for r in raw["records"][str(rate)]]
        s = summarize(records, slos["both"])
        s["goodput_ttft_rps"] = summarize(records, slos["ttft"])["goodput_rps"]
        s["goodput_tpot_rps"] = summarize(records, slos["tpot"])["goodput_rps"]
        s["rate"] = rate
        s["raw"] = raw["records"][str(rate)]
        rows.append(s)
    return rows


def transfer_figures(loads: dict[str, dict[str, Any]]) -> dict[str, Any]:
    received = sum(int(w.get("kv_bytes_received", 0)) for w in loads.values())
    transfers = sum(int(w.get("kv_transfers_received", 0)) for w in loads.values())
    seconds = sum(float(w.get("kv_transfer_seconds", 0)) for w in loads.values() if int(w.get("kv_transfers_received", 0)))
    if not transfers:
        return {"transfers": 0}
    mean = received // transfers
    return {"transfers": transfers, "bytes": received, "mean_transfer_mb": mean / 1e6,
            "failures": sum(int(w.get("kv_transfer_failures", 0)) for w in loads.values()),
            "transfer_mb_s": received / max(seconds, 1e-9) / 1e6, "memcpy_mb_s": memcpy_mb_s(mean)}


def print_report(res: dict[str, Any]) -> None:
    c = res["config"]
    print(f"\nSLOs: TTFT <= {c['slo_ttft_ms']:g} ms, tight TPOT <= {c['slo_tpot_ms']:g} ms; "
          f"{c['num_requests']} requests per rate, prompts {c['min_prompt']}-{c['max_prompt']} tokens, "
          f"outputs {c['min_output']}-{c['max_output']}")
    print(f"{'rate':>6} {'config':>10} {'ok':>5} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} "
          f"{'good TTFT':>9} {'good TPOT':>9} {'good both':>9}")
    for rate in c["rates"]:
        for name in ("colocated", "disagg"):
            r = next(x for x in res["results"][name] if x["rate"] == rate)
            print(f"{rate:>6g} {name:>10} {r['completed']:>2}/{r['num_requests']:<2} {r['ttft']['p50_ms']:>9.0f} "
                  f"{r['ttft']['p90_ms']:>9.0f} {r['tpot']['p50_ms']:>9.1f} {r['tpot']['p90_ms']:>9.1f} "
                  f"{r['goodput_ttft_rps']:>9.3f} {r['goodput_tpot_rps']:>9.3f} {r['goodput_rps']:>9.3f}")
        ratio = {k: "n/a (colocated 0)" if v is None else f"x{v}" for k, v in res["ratios"][str(rate)].items()}
        print(f"{'':>6} {'disagg/colo':>10} goodput at the tight TPOT SLO {ratio['goodput_tpot']}, TTFT p90 "
              f"{ratio['ttft_p90']}, TPOT p90 {ratio['tpot_p90']}")
    t = res["kv_transfer"]
    if t.get("transfers"):
        print(f"\nKV transfer: {t['transfers']} transfers, mean {t['mean_transfer_mb']:.1f} MB, "
              f"{t['transfer_mb_s']:.0f} MB/s over gloo vs {t['memcpy_mb_s']:.0f} MB/s plain memcpy, "
              f"{t['failures']} failures")


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [("goodput_tpot_rps", "goodput, tight TPOT SLO (req/s)"), ("goodput_ttft_rps", "goodput, TTFT SLO (req/s)"),
              (("tpot", "p90_ms"), "TPOT p90 (ms)"), (("ttft", "p90_ms"), "TTFT p90 (ms)")]
    for name, style in (("colocated", "-o"), ("disagg", "-s")):
        rows = res["results"][name]
        xs = [r["rate"] for r in rows]
        for ax, (key, title) in zip(axes, panels):
            ys = [r[key] if isinstance(key, str) else r[key[0]][key[1]] for r in rows]
            ax.plot(xs, ys, style, label=name)
            ax.set_title(title)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"disaggregated (1 prefill + 1 decode) vs colocated (2 workers), 1 CPU each - commit "
                 f"{str(res['code'].get('commit'))[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from cluster.bench.load_gen import build_workload
    from cluster.bench.report import code_version as _code_version, machine as _machine
    from workers.models.assets.resolve import resolve_model

    if args.quick:
        args.rates, args.num_requests = "0.5,1", 8
    rates = [float(r) for r in args.rates.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    per_rate = []  # distinct requests for each rate: [rate index][request]
    for i in range(len(rates)):
        texts = long_prompts(tokenizer, args.num_requests, args.min_prompt, args.max_prompt, args.seed + 1000 * i)
        per_rate.append([build_workload(tokenizer, 1, seed=args.seed + 1000 * i + j, min_output=args.min_output,
                                        max_output=args.max_output, prompts=[text])[0] for j, text in enumerate(texts)])
    res: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                      if k not in ("target", "workload", "records")},
                           "machine": _machine(), "code": _code_version(), "results": {}, "runs": {}}
    res["config"]["rates"] = rates
    res["config"]["prompt_tokens"] = [[len(r.prompt_ids) for r in rs] for rs in per_rate]
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.json"
        workload.write_text(json.dumps({"seed": args.seed, "rates": rates, "requests": [
            [{"prompt": r.prompt, "ids": list(r.prompt_ids), "max_tokens": r.max_tokens} for r in rs]
            for rs in per_rate]}))
        for name, pools in configs(args.model).items():
            logger.info("configuration %s: starting", name)
            raw = run_configuration(name, pools, args, workload, rates)
            res["results"][name] = summarize_configuration(raw, rates, args)
            res["runs"][name] = {k: v for k, v in raw.items() if k != "records"}
    res["kv_transfer"] = transfer_figures(res["runs"]["disagg"]["loads"])
    res["ratios"] = {}
    for rate in rates:
        co, di = (next(x for x in res["results"][n] if x["rate"] == rate) for n in ("colocated", "disagg"))
        res["ratios"][str(rate)] = {"goodput_tpot": _ratio(di["goodput_tpot_rps"], co["goodput_tpot_rps"]),
                                    "goodput_both": _ratio(di["goodput_rps"], co["goodput_rps"]),
                                    "ttft_p90": _ratio(di["ttft"]["p90_ms"], co["ttft"]["p90_ms"]),
                                    "tpot_p90": _ratio(di["tpot"]["p90_ms"], co["tpot"]["p90_ms"])}
    return res


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.target:
        return run_client(args)
    res = run(args)
    print_report(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str))
    png = args.out.with_suffix(".png")
    plot(res, png)
    print(f"\nwrote {args.out}\nwrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
