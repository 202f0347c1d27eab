"""Time per engine step outside the kernels, and the serving path's work per token, at 8-256 sequences.

    .venv/bin/python benchmarks/step_overhead.py [--quick] [--quant q4] [--batches 8,32,64,128,256]
                                                 [--threads 1] [--out PATH]

Sections (one JSON, ``benchmarks/results/step_overhead.json``; ``step_overhead_quick.json`` with --quick):

    engine     N sequences decoding together (prompt --prompt-tokens, ignore_eos), greedy and
               temperature 1.0; per step the engine's own spans (workers/engine/engine.py
               StepTiming, the runner's RunnerTiming): schedule, prepare (inputs + metadata),
               forward + logits (the kernels), sample, commit, postprocess (stop rules,
               detokenization), and the engine loop's load snapshot (workers/engine/loop.py). Medians
               over --steps steps; ``outside_share`` = (step - kernels) / step.
    serving    the same steps' outputs through the code every token passes after the engine: the
               worker's message (workers/server/service.py ``_merge`` + serialisation) and the
               router's work (parse, incremental detokenization, the client's GenerateResponse,
               the OpenAI chunk and its SSE line): microseconds per token, in this process.
    transport  gRPC streaming itself (a server in a child process, the client here): CPU time per
               message on each side at 1 / 16 / 64 concurrent streams, one message per token per
               stream (today's Submit), beside one message per step carrying every stream's token (a
               multiplexed stream's cost), measured with psutil / getrusage.
    draw       the sampler's draw at N rows: ``torch.multinomial`` per row (the exponential race
               over the vocabulary, the sampler before this benchmark) vs workers/sample/draw.py
               (one uniform per row, a batched inverse-CDF search), same probabilities.

Every figure is a median; the machine's load average is recorded before and after (a 2-core
machine shared with others inflates absolute times; the shares and ratios are what to read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB_PROMPT_RANGE = (100, 30000)  # prompt ids drawn from this range (ordinary tokens)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# ------------------------------------------------------------------------------------ engine
def _engine(args: argparse.Namespace, quant: str, max_n: int):
    from workers.build import build_engine
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.models.assets.resolve import resolve_model

    path = resolve_model(args.model)
    tokens_per_seq = args.prompt_tokens + args.warmup_steps + args.steps + 32  # KV blocks for exactly this
    config = EngineConfig(
        model=str(path), quantization=quant,
        cache=CacheConfig(kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False,
                          num_blocks=max_n * (-(-tokens_per_seq // 16)) + 8),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(512, max_n), max_num_seqs=max_n))
    engine = build_engine(config)
    engine.warm_up()
    return engine


def measure_engine(args: argparse.Namespace, quant: str) -> list[dict[str, Any]]:
    """Step spans per batch size and temperature (see the module doc); also keeps the outputs for
    the serving section."""
    from workers.engine.loop import LoadSnapshot
    from workers.sampling_params import SamplingParams

    engine = _engine(args, quant, max(args.batches))
    rows = []
    for temperature in args.temperatures:
        for n in args.batches:
            ids = [f"b{n}-t{temperature}-{i}" for i in range(n)]
            lo, hi = VOCAB_PROMPT_RANGE
            for k, rid in enumerate(ids):
                prompt = [lo + (k * 7919 + j * 104729) % (hi - lo) for j in range(args.prompt_tokens)]
                engine.add_request(rid, prompt, SamplingParams(max_tokens=100_000, temperature=temperature,
                                                               ignore_eos=True, seed=k))
            while any(not s.in_decode for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()
            for _ in range(args.warmup_steps):
                engine.step()
            spans: dict[str, list[float]] = {k: [] for k in (
                "step", "schedule", "prepare", "forward", "logits", "sample", "commit", "postprocess", "snapshot")}
            outputs = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = engine.step()
                t1 = time.perf_counter()
                LoadSnapshot.of(engine)
                snap = time.perf_counter() - t1
                st = engine.last_step
                assert st is not None and st.runner is not None and st.num_decode_rows == n, st
                r = st.runner
                for key, v in (("step", t1 - t0), ("schedule", st.schedule_s), ("prepare", r.prepare_s),
                               ("forward", r.forward_s), ("logits", r.logits_s), ("sample", r.sample_s),
                               ("commit", st.commit_s), ("postprocess", st.postprocess_s), ("snapshot", snap)):
                    spans[key].append(v)
                outputs.append(out)
            for rid in ids:
                engine.abort(rid)
            steps = [a + b for a, b in zip(spans["step"], spans["snapshot"])]
            kernels = [a + b for a, b in zip(spans["forward"], spans["logits"])]
            outside = [s - k for s, k in zip(steps, kernels)]
            row = {"quant": quant, "temperature": temperature, "batch": n,
                   "ms": {k: 1e3 * _median(v) for k, v in spans.items()},
                   "step_ms": 1e3 * _median(steps), "kernels_ms": 1e3 * _median(kernels),
                   "outside_ms": 1e3 * _median(outside),
                   "outside_share": _median([o / s for o, s in zip(outside, steps)]),
                   "outside_us_per_seq": 1e6 * _median(outside) / n,
                   "tokens_per_s": n / _median(steps)}
            row["serving"] = measure_serving(engine.tokenizer, outputs)
            rows.append(row)
            print(f"{quant} T={temperature} N={n:4d}: step {row['step_ms']:8.1f} ms, kernels {row['kernels_ms']:8.1f}, "
                  f"outside {row['outside_ms']:6.2f} ms ({100 * row['outside_share']:4.1f}%; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["ms"].items() if k not in ("step", "forward", "logits"))
                  + f"); serving {row['serving']['worker_us_per_token']:.0f} + {row['serving']['router_us_per_token']:.0f}"
                  " us/token", flush=True)
    return rows


# ----------------------------------------------------------------------------------- serving
def measure_serving(tokenizer: Any, steps: list[list[Any]]) -> dict[str, float]:
    """The per-token work after the engine, on real step outputs (see the module doc)."""
    from protos.duet.v1 import duet_pb2
    from protos.duet.worker.v1 import worker_pb2
    from router.http_api.render import Renderer, TokenText
    from router.http_api.streaming import sse
    from router.worker_stream import _detokenize
    from workers.detokenizer import IncrementalDetokenizer
    from workers.server.service import _merge

    detoks: dict[str, IncrementalDetokenizer] = {}
    renderers: dict[str, Renderer] = {}
    token_text = TokenText(tokenizer)
    worker_s = router_s = 0.0
    tokens = 0
    for outs in steps:
        wires = []
        t0 = time.perf_counter()
        for o in outs:
            wires.append(_merge([o]).SerializeToString())
        t1 = time.perf_counter()
        for o, wire in zip(outs, wires):
            msg = worker_pb2.SubmitResponse.FromString(wire)
            detok = detoks.get(o.request_id)
            if detok is None:
                detok = detoks[o.request_id] = IncrementalDetokenizer(tokenizer, [1, 2, 3])
                renderers[o.request_id] = Renderer(chat=False, request_id=o.request_id, model="m",
                                                   token_text=token_text, logprobs=False)
            ids, text, _ = _detokenize(detok, msg.token_ids)
            response = duet_pb2.GenerateResponse(request_id=o.request_id, text=text, token_ids=ids)
            chunk = renderers[o.request_id].chunk(response)
            if chunk is not None:
                sse(chunk)
        t2 = time.perf_counter()
        worker_s += t1 - t0
        router_s += t2 - t1
        tokens += sum(len(o.new_token_ids) for o in outs)
    return {"worker_us_per_token": 1e6 * worker_s / max(tokens, 1), "router_us_per_token": 1e6 * router_s / max(tokens, 1)}


# --------------------------------------------------------------------------------- transport
_SERVER = r'''
import asyncio, sys
import grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

class W(worker_pb2_grpc.WorkerServicer):
    async def Submit(self, request, context):
        # a message carries the request's prompt ids: 1 (a token of one stream) or N (a step's tokens)
        for i in range(request.sampling.max_tokens):
            yield worker_pb2.SubmitResponse(token_ids=request.prompt_token_ids)
            await asyncio.sleep(0)

async def main():
    s = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(W(), s)
    print(s.add_insecure_port("127.0.0.1:0"), flush=True)
    await s.start()
    await s.wait_for_termination()

asyncio.run(main())
'''


def measure_transport(streams: list[int], steps: int) -> list[dict[str, Any]]:
    """CPU per message of gRPC streaming, per token per stream vs one message per step (module doc)."""
    import grpc
    import psutil

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.stdout is not None  # stdout=PIPE
    try:
        port = int(proc.stdout.readline())
        server = psutil.Process(proc.pid)

        async def run(n: int, per_step: bool, steps: int) -> tuple[float, float, int]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)

                async def one(ids: list[int]) -> int:
                    req = worker_pb2.SubmitRequest(request_id="x", prompt_token_ids=ids,
                                                   sampling=worker_pb2.SamplingParams(max_tokens=steps))
                    return sum([1 async for _ in stub.Submit(req)])

                calls = [one(list(range(100, 100 + n)))] if per_step else [one([100 + k]) for k in range(n)]
                await one([1])  # connect, warm up
                s0, c0 = server.cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
                msgs = sum(await asyncio.gather(*calls))
                s1, c1 = server.cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
            return ((s1.user + s1.system - s0.user - s0.system), (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime),
                    msgs)

        rows = []
        for n in streams:
            for per_step in (False, True):
                n_steps = max(steps, 8192 // n)  # >= 8192 tokens: CPU times tick every 10 ms
                reps = [asyncio.run(run(n, per_step, n_steps)) for _ in range(3)]
                tokens = n * n_steps
                server_s = _median([r[0] for r in reps])
                client_s = _median([r[1] for r in reps])
                row = {"streams": n, "layout": "per_step" if per_step else "per_token", "messages": reps[0][2],
                       "server_us_per_token": 1e6 * server_s / tokens, "client_us_per_token": 1e6 * client_s / tokens}
                rows.append(row)
                print(f"transport {row['layout']:9s} streams={n:3d}: server {row['server_us_per_token']:6.1f} + "
                      f"client {row['client_us_per_token']:6.1f} us CPU per token", flush=True)
        return rows
    finally:
        proc.kill()
        proc.wait()


# -------------------------------------------------------------------------------------- draw
def measure_draw(batches: list[int], vocab: int, reps: int) -> list[dict[str, Any]]:
    from workers.sample.draw import draw

    rows = []
    for n in batches:
        probs = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * 3).softmax(-1)
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        times: dict[str, list[float]] = {"multinomial": [], "inverse_cdf": []}
        for _ in range(reps):
            for name in times:
                t = time.perf_counter()
                if name == "multinomial":
                    [int(torch.multinomial(probs[i], 1, generator=gens[i])) for i in range(n)]
                else:
                    draw(probs, gens)
                times[name].append(time.perf_counter() - t)
        row = {"batch": n, **{f"{k}_ms": 1e3 * _median(v) for k, v in times.items()}}
        row["speedup"] = row["multinomial_ms"] / row["inverse_cdf_ms"]
        rows.append(row)
        print(f"draw N={n:4d}: multinomial {row['multinomial_ms']:8.2f} ms, inverse CDF {row['inverse_cdf_ms']:6.2f} ms "
              f"({row['speedup']:.0f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quant", default="q4", help="comma list of none | int8 | q4 (default q4)")
    p.add_argument("--batches", default="8,32,64,128,256")
    p.add_argument("--temperatures", default="0,1.0")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core per server)")
    p.add_argument("--sections", default="engine,transport,draw")
    p.add_argument("--quick", action="store_true", help="batches 8,64, 5 steps, one temperature (1.0)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.steps, args.temperatures = "8,64", 5, "1.0"
    args.batches = [int(x) for x in args.batches.split(",")]
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.threads)
    out = args.out or RESULTS / ("step_overhead_quick.json" if args.quick else "step_overhead.json")
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "threads": args.threads,
                           "load_avg_before": os.getloadavg(), "python": platform.python_version(),
                           "cpu": _cpu_model(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    if "engine" in sections:
        res["engine"] = [r for q in args.quant.split(",") for r in measure_engine(args, q)]
    if "transport" in sections:
        res["transport"] = measure_transport([1, 16, 64], 32 if args.quick else 128)
    if "draw" in sections:
        res["draw"] = measure_draw(args.batches, 49152, 3 if args.quick else 7)
    res["load_avg_after"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} (load average {res['load_avg_before']} -> {res['load_avg_after']})")
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
