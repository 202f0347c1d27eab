"""Structured-output benchmark (issue 23), in one run on the embedded SmolLM2-135M:

1. decode tokens/s of JSON-schema-constrained requests vs the same requests unconstrained, at batch
   1 and batch 16 (target >= 0.9x). The schema asks for a long array, so both sides generate exactly
   ``--max-tokens`` tokens (the unconstrained side with ignore_eos): the same work, token for token.
   Sampled (temperature 1, a seed per request). Runs alternate free / constrained per repeat;
   medians are reported with the CPU load other processes caused.
2. grammar compile time per schema: cold (a fresh compiler: the llguidance tokenizer is built
   first and reported apart) and cached (the LRU hit a repeated schema gets).
3. the constrained run with speculative decoding (n-gram, greedy) vs without: tokens/s and the
   check that the outputs are identical.

    flock /tmp/duet-heavy.lock python benchmarks/structured_bench.py   # ~5 min on 2 quiet cores

Writes benchmarks/results/structured_bench.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import CpuLoadMeter, code_version, machine_info  # noqa: E402
from workers.config import SpeculativeConfig  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.models.assets.prepare import prepare_smollm2  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.structured.grammar import GrammarCompiler, build_tokenizer  # noqa: E402
from workers.structured.spec import StructuredOutput  # noqa: E402

logger = logging.getLogger("structured_bench")
RESULTS = REPO_ROOT / "benchmarks" / "results"

# Long on purpose (at least 40 items): every request runs to max_tokens, like the free ones.
LONG_SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
    "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 24},
                   "score": {"type": "number", "minimum": 0, "maximum": 1},
                   "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}, "maxItems": 3}}}}
COMPILE_SCHEMAS = {
    "small_object": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                     "required": ["a"]},
    "long_array": LONG_SCHEMA,
    "nested": {"type": "object", "required": ["user", "items"], "properties": {
        "user": {"type": "object", "required": ["name", "email"], "properties": {
            "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "format": "email"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"pattern": "^[0-9]{5}$",
                                                                                                "type": "string"}}}}},
        "items": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"enum": ["x", "y"]}]},
                  "minItems": 1, "maxItems": 10}}},
    "enum_heavy": {"type": "object", "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(20)]} for i in range(20)}},
}
PROMPTS = [f"List {n} inventory records as JSON, one object per item, with id, name, score and tags."
           for n in range(40, 56)]


def timed_generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs), outs


def decode_rates(llm: LLM, batch: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    spec = StructuredOutput("json_schema", json.dumps(LONG_SCHEMA))
    prompts = PROMPTS[:batch]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(batch)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured=spec) for i in range(batch)]
    timed_generate(llm, prompts[:1], constrained[:1])  # compile + warm up (not measured)
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    meter = CpuLoadMeter()
    for _ in range(repeats):
        for name, params in (("free", free), ("constrained", constrained)):
            seconds, tokens, outs = timed_generate(llm, prompts, params)
            assert tokens == batch * max_tokens, f"{name}: {tokens} tokens, expected {batch * max_tokens}"
            assert all(o.error is None for o in outs)
            rates[name].append(tokens / seconds)
    free_tps, cons_tps = statistics.median(rates["free"]), statistics.median(rates["constrained"])
    row = {"batch": batch, "max_tokens": max_tokens, "repeats": repeats, "free_tok_s": rates["free"],
           "constrained_tok_s": rates["constrained"], "median_free_tok_s": free_tps,
           "median_constrained_tok_s": cons_tps, "ratio": cons_tps / free_tps, "others_cpu_load": meter.read()}
    logger.info("batch %d: free %.1f tok/s, constrained %.1f tok/s, ratio %.3f (others' load %.2f)", batch,
                free_tps, cons_tps, row["ratio"], row["others_cpu_load"])
    return row


def compile_times(tokenizer: Any, vocab_size: int, eos: list[int], repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    build_tokenizer(tokenizer, vocab_size, eos)
    out: dict[str, Any] = {"tokenizer_build_s": time.perf_counter() - t0, "schemas": {}}
    for name, schema in COMPILE_SCHEMAS.items():
        spec = StructuredOutput("json_schema", json.dumps(schema))
        cold, cached = [], []
        for _ in range(repeats):
            compiler = GrammarCompiler(tokenizer, vocab_size, eos)
            _ = compiler.tokenizer  # built before the clock starts: compile time only
            t = time.perf_counter()
            compiler.compile(spec)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.compile(spec)
            cached.append(time.perf_counter() - t)
            compiler.close()
        out["schemas"][name] = {"cold_ms_median": statistics.median(cold) * 1e3,
                                "cached_ms_median": statistics.median(cached) * 1e3}
        logger.info("compile %s: cold %.2f ms, cached %.3f ms", name, out["schemas"][name]["cold_ms_median"],
                    out["schemas"][name]["cached_ms_median"])
    return out


def spec_decode(path: str, batch: int, max_tokens: int, repeats: int, kv: int, **engine: Any) -> dict[str, Any]:
    spec = StructuredOutput("json_schema", json.dumps(LONG_SCHEMA))
    prompts = PROMPTS[:batch]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec) for _ in prompts]
    plain = LLM(path, kv_cache_memory_bytes=kv, **engine)
    ngram = LLM(path, kv_cache_memory_bytes=kv, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                **engine)
    timed_generate(plain, prompts[:1], params[:1])
    timed_generate(ngram, prompts[:1], params[:1])
    rates: dict[str, list[float]] = {"plain": [], "ngram": []}
    outputs: dict[str, list[list[int]]] = {}
    meter = CpuLoadMeter()
    for _ in range(repeats):
        for name, llm in (("plain", plain), ("ngram", ngram)):
            seconds, tokens, outs = timed_generate(llm, prompts, params)
            rates[name].append(tokens / seconds)
            outputs[name] = [o.token_ids for o in outs]
    s = ngram.engine.stats().spec
    row = {"batch": batch, "max_tokens": max_tokens, "plain_tok_s": rates["plain"], "ngram_tok_s": rates["ngram"],
           "ratio": statistics.median(rates["ngram"]) / statistics.median(rates["plain"]),
           "identical_outputs": outputs["plain"] == outputs["ngram"], "acceptance_rate": s.acceptance_rate,
           "mean_accepted_length": s.mean_accepted_length, "others_cpu_load": meter.read()}
    logger.info("spec decode (greedy, constrained) batch %d: plain %.1f, ngram %.1f tok/s, ratio %.3f, identical %s, "
                "acceptance %.2f", batch, statistics.median(rates["plain"]), statistics.median(rates["ngram"]),
                row["ratio"], row["identical_outputs"], s.acceptance_rate)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats per batch (default 3)")
    ap.add_argument("--spec-batch", type=int, default=1, help="batch of the speculative-decoding part (default 1)")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2-135M-Instruct); "
                    "e.g. random SmolLM2-shaped weights with SmolLM2's tokenizer on a machine without the model")
    ap.add_argument("--device", default="cpu", help="engine device (default cpu)")
    ap.add_argument("--dtype", default="float32", help="engine dtype (default float32)")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_bench.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = args.model or str(prepare_smollm2())
    kv = 256 << 20
    engine = dict(device=args.device, dtype=args.dtype)
    llm = LLM(path, kv_cache_memory_bytes=kv, **engine)
    result: dict[str, Any] = {"machine": machine_info(), "code": code_version(), "model": path, **engine,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result["compile"] = compile_times(llm.tokenizer, llm.engine.spec.vocab_size, sorted(llm.engine.eos_token_ids),
                                      args.repeats)
    result["decode"] = [decode_rates(llm, b, args.max_tokens, args.repeats) for b in args.batches]
    del llm
    result["spec_decode"] = spec_decode(path, args.spec_batch, args.max_tokens, args.repeats, kv, **engine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
