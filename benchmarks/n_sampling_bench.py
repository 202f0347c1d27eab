"""n samples of one prompt vs one sample, at the engine level, in one run.

    python -m benchmarks.n_sampling_bench [--prompt-tokens 500] [--max-tokens 32] [--n 4] [--repeats 5]

Three cases, each from a cold prefix cache (reset before every run), the same prompt token ids
(``--prompt-tokens`` from cluster/bench/data/serving_prompts.txt), sampled at temperature 0.8 with a
seed, ``--max-tokens`` tokens per choice (ignore_eos, so every choice has the same length):
    n=1           one request
    n=N shared    what router/fanout.py does: choice 0 first; once it has its first token (its prompt
                  is in the prefix cache) the other N - 1 (seeds seed+i) join and reuse the prompt's
                  full blocks, computing only its last partial block, then all decode together
    n=N unshared  the N requests at once with prefix caching off (every choice computes the prompt)
Figures: wall time of each case (median over ``--repeats``, cases alternated within a repeat),
and the ratios n=N shared / n=1 (target < 2) and unshared / shared. ``torch.set_num_threads`` is
``--threads`` (2). Writes JSON to ``--out`` (default benchmarks/results/n_sampling_bench.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "n_sampling_bench.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="n_sampling_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def _prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    from cluster.bench.load_gen import PROMPTS_FILE

    text = PROMPTS_FILE.read_text()
    ids = tokenizer.encode(text)
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def _params(seed: int, max_tokens: int):
    from workers.sampling_params import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _drain(engine, ids: set[str], outputs: dict[str, list[int]], until_first: str | None = None) -> None:
    """Step until every id in ``ids`` finished (or ``until_first`` has its first token)."""
    while ids:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                ids.discard(out.request_id)
        if until_first is not None and outputs.get(until_first):
            return


def run_case(engine, prompt: list[int], n: int, max_tokens: int, shared: bool, tag: str) -> tuple[float, dict]:
    engine.block_manager.reset_prefix_cache()
    outputs: dict[str, list[int]] = {}
    ids = [f"{tag}-{i}" for i in range(n)]
    t0 = time.perf_counter()
    if shared:
        engine.add_request(ids[0], prompt, _params(7, max_tokens))
        pending = {ids[0]}
        _drain(engine, pending, outputs, until_first=ids[0])
        for i, rid in enumerate(ids[1:], 1):
            engine.add_request(rid, prompt, _params(7 + i, max_tokens))
            pending.add(rid)
        _drain(engine, pending, outputs)
    else:
        for i, rid in enumerate(ids):
            engine.add_request(rid, prompt, _params(7 + i, max_tokens))
        _drain(engine, set(ids), outputs)
    seconds = time.perf_counter() - t0
    assert all(len(outputs[r]) == max_tokens for r in ids), "every choice makes exactly max_tokens tokens"
    stats = engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return seconds, outputs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from workers.build import build_engine
    from workers.config import CacheConfig, EngineConfig
    from workers.models.assets.resolve import resolve_model

    torch.set_num_threads(args.threads)
    model = str(resolve_model(args.model))  # a name becomes a checkpoint dir
    cache = CacheConfig(kv_cache_memory_bytes=256 << 20)
    engine = build_engine(EngineConfig(model=model, cache=cache))
    unshared = build_engine(EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=256 << 20,
                                                                        enable_prefix_caching=False)))
    prompt = _prompt(engine.tokenizer, args.prompt_tokens)
    cases = {"n=1": (engine, 1, False), f"n={args.n} shared": (engine, args.n, True),
             f"n={args.n} unshared": (unshared, args.n, False)}
    for name, (eng, n, shared) in cases.items():  # warm-up
        run_case(eng, prompt, n, 4, shared, f"warm-{name}")
    times: dict[str, list[float]] = {name: [] for name in cases}
    first_choice: dict[str, list[int]] = {}
    for r in range(args.repeats):
        order = list(cases.items()) if r % 2 == 0 else list(reversed(cases.items()))
        for name, (eng, n, shared) in order:
            seconds, outputs = run_case(eng, prompt, n, args.max_tokens, shared, f"{name}-{r}")
            times[name].append(seconds)
            first_choice[name] = outputs[f"{name}-{r}-0"]
    # The same seed and prompt: choice 0 is the same sample in every case.
    assert len({tuple(v) for v in first_choice.values()}) == 1, "choice 0 differs between cases"
    med = {name: statistics.median(v) for name, v in times.items()}
    shared_ratio = med[f"n={args.n} shared"] / med["n=1"]
    result = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT).stdout.strip(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads},
        "args": {k: str(v) for k, v in vars(args).items()},
        "seconds": times, "median_s": med,
        "ratio_shared_vs_n1": shared_ratio,
        "ratio_unshared_vs_shared": med[f"n={args.n} unshared"] / med[f"n={args.n} shared"],
        "target_met": shared_ratio < 2.0,
    }
    print(f"{args.prompt_tokens}-token prompt, {args.max_tokens} tokens per choice, {args.repeats} repeats (median):")
    for name, m in med.items():
        print(f"  {name:<14} {m * 1e3:8.1f} ms")
    print(f"  n={args.n} shared / n=1: {shared_ratio:.2f}x (target < 2: {'yes' if shared_ratio < 2 else 'NO'}); "
          f"unshared / shared: {result['ratio_unshared_vs_shared']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
