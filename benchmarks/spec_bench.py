"""Speculative decoding benchmark: the same prompts with and without speculation, in one run.

Part ``ngram`` (SmolLM2-135M, prompt lookup): two prompt classes -- *repetitive* (the answer quotes
the prompt: copy, edit and reformat tasks) and *open* (free text, where prompt lookup finds little)
-- at batch 1 (each prompt alone) and batch 8 (all at once). Targets: >= 1.5x tokens/s on
repetitive prompts, >= 0.95x on open ones (the adaptive draft length must not lose time there).

Part ``pair`` (Qwen2.5-Coder-1.5B target, 0.5B drafter; optional assets, `make qwen-coder`): our
engine with the drafter in its own Ray actor (a CPU drafter) vs the same engine without
speculation vs HF ``generate(assistant_model=...)`` vs HF plain, at batch 1 (and batch 8 for our
engine; HF assisted generation supports batch 1 only). Target: >= 1.8x over our own plain decode at
batch 1, ahead of HF assisted generation.

Threads: this machine has 2 cores. Plain engine and HF runs use both. The pair either splits the
cores (``--target-threads 1 --drafter-threads 1``, overlap on: drafter and target run at the same
time, one core each) or time-shares them (``--target-threads 2 --drafter-threads 2 --no-overlap``:
they take turns, each with both cores). Never both at once with overlap on: OpenMP spin-waits make
oversubscription 10x slower. ``--draft-vocab`` prunes the drafter's LM head (draft_vocab.py). Runs alternate
plain / speculative per repeat; medians are reported with the CPU load others caused (see
engine_throughput.CpuLoadMeter). Every speculative output is checked against the plain one
(greedy: they must be identical).

    python benchmarks/spec_bench.py --part ngram            # ~3 min
    python benchmarks/spec_bench.py --part pair             # ~15 min, needs the Qwen assets
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import CpuLoadMeter, code_version, machine_info  # noqa: E402
from workers.config import SpeculativeConfig  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("spec_bench")
RESULTS = REPO_ROOT / "benchmarks" / "results"

_CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users
'''
REPETITIVE = [
    f"Add a docstring to this function and return the whole function:\n\n{_CODE}",
    f"Rename the variable `users` to `people` in this code and print the full code:\n\n{_CODE}",
    "Copy this list exactly, one item per line: apples, pears, plums, cherries, grapes, lemons, limes, "
    "oranges, peaches, melons",
    "Repeat the sentence three times: The quick brown fox jumps over the lazy dog.",
    f"Convert this function to use a list comprehension where possible; show the full result:\n\n{_CODE}",
    "Write the word 'hello' in a numbered list ten times.",
    "Fix the typo and rewrite the paragraph unchanged otherwise: The comittee met on Tuesday to "
    "discuss the budget. The comittee agreed to meet again next week to finalize the budget.",
    "Format as a markdown table with columns name and price: apple 1.20, pear 0.80, plum 0.50, "
    "cherry 3.00, grape 2.10",
]
OPEN = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "What are three tips for learning a new language?",
    "Describe the taste of coffee to someone who has never had it.",
    "Give me a recipe idea for dinner tonight.",
    "What is the difference between weather and climate?",
    "Suggest a name for a new bakery and explain it.",
    "Why do cats purr?",
]
CODE_TASKS = [
    "Write a Python function that checks whether a string is a palindrome.",
    f"Add type hints to this function and return the full code:\n\n{_CODE}",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python class Stack with push, pop and peek methods.",
    f"Rewrite this function to use the csv module; show the full code:\n\n{_CODE}",
    "Write a Python function that merges two sorted lists.",
    "Write a function that counts word frequencies in a text and returns the top 5.",
    f"Add error handling for malformed lines to this function; show the full code:\n\n{_CODE}",
]


def chat(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int, speculate: bool = True
               ) -> tuple[float, list[list[int]]]:
    """Greedy; speculate False runs the same engine with speculation off for these requests."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=None if speculate else 0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def spec_delta(llm: LLM, before) -> dict[str, Any]:
    s = llm.engine.stats().spec
    drafted = s.num_draft_tokens - before.num_draft_tokens
    verifies = s.num_verifies - before.num_verifies
    return {"acceptance_rate": (s.num_accepted_tokens - before.num_accepted_tokens) / drafted if drafted else 0.0,
            "mean_accepted_length": (s.num_emitted_tokens - before.num_emitted_tokens) / verifies if verifies else 0.0,
            "draft_tokens": drafted, "verifies": verifies, "fallbacks": s.num_fallbacks - before.num_fallbacks}


def _paired(runs: dict[str, list[float]]) -> float:
    """Median of each speculative run over the plain run just before it (same prompts, seconds apart):
    steadier than the ratio of medians when others' load comes and goes."""
    return statistics.median(b / a for a, b in zip(runs["plain_tok_s"], runs["spec_tok_s"]))


def compare(spec: LLM, batches: list[list[list[int]]], max_tokens: int, repeats: int,
            plain_threads: int, spec_threads: int, kept: set[int] | None = None) -> dict[str, Any]:
    """Alternate plain / speculative over ``batches`` (each run as one generate call) on one engine:
    plain = the same engine and weights with speculation off per request. kept: a pruned drafter's
    vocabulary (draft_vocab_coverage = the share of plain output tokens inside it)."""
    rows: dict[str, list] = {"plain_tok_s": [], "spec_tok_s": [], "load": []}
    agg: dict[str, Any] = {}
    mismatches = covered = outputs = 0
    for _ in range(repeats):
        meter = CpuLoadMeter()
        for batch in batches:
            torch.set_num_threads(plain_threads)
            t_plain, out_plain = run_engine(spec, batch, max_tokens, speculate=False)
            torch.set_num_threads(spec_threads)
            before = spec.engine.stats().spec
            t_spec, out_spec = run_engine(spec, batch, max_tokens)
            d = spec_delta(spec, before)
            agg = {k: (agg or {}).get(k, 0) + v for k, v in d.items() if k in ("draft_tokens", "verifies", "fallbacks")} | {
                "acc": (agg or {}).get("acc", 0) + d["acceptance_rate"] * d["draft_tokens"],
                "emit": (agg or {}).get("emit", 0) + d["mean_accepted_length"] * d["verifies"]}
            n = sum(map(len, out_plain))
            covered += sum(t in kept for out in out_plain for t in out) if kept else 0
            outputs += n
            mismatches += sum(a != b for a, b in zip(out_plain, out_spec))
            rows["plain_tok_s"].append(n / t_plain)
            rows["spec_tok_s"].append(sum(map(len, out_spec)) / t_spec)
        rows["load"].append(meter.read())
    p, s = statistics.median(rows["plain_tok_s"]), statistics.median(rows["spec_tok_s"])
    return {"plain_tokens_per_s": round(p, 2), "spec_tokens_per_s": round(s, 2), "speedup": round(s / p, 3),
            "speedup_paired_median": round(_paired(rows), 3),
            "acceptance_rate": round(agg["acc"] / agg["draft_tokens"], 3) if agg["draft_tokens"] else 0.0,
            "mean_accepted_length": round(agg["emit"] / agg["verifies"], 3) if agg["verifies"] else 0.0,
            "fallbacks": agg["fallbacks"], "greedy_mismatches": mismatches,
            "mean_draft_length": round(agg["draft_tokens"] / agg["verifies"], 3) if agg["verifies"] else 0.0,
            "others_cpu_load": [round(x, 2) for x in rows["load"]], "runs": rows,
            "draft_vocab_coverage": round(covered / outputs, 4) if kept and outputs else None}


# ------------------------------------------------------------------- ngram
def part_ngram(args) -> dict[str, Any]:
    spec = LLM("SmolLM2-135M-Instruct", kv_cache_memory_bytes=256 << 20,
               speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=args.k))
    tok = spec.tokenizer
    out: dict[str, Any] = {}
    for name, prompts in (("repetitive", REPETITIVE), ("open", OPEN)):
        ids = [chat(tok, p) for p in prompts]
        for speculate in (False, True):  # warm-up: kernel loading, allocator growth
            run_engine(spec, ids[:2], 8, speculate)
        out[f"{name}_batch1"] = compare(spec, [[x] for x in ids], args.max_tokens, args.repeats, 2, 2)
        out[f"{name}_batch8"] = compare(spec, [ids], args.max_tokens, args.repeats, 2, 2)
        logger.info("%s: %s", name, {k: v["speedup"] for k, v in out.items()})
    return out


# -------------------------------------------------------------------- pair
def _hf_generate(model, ids: list[int], max_tokens: int, assistant=None) -> tuple[float, list[int]]:
    x = torch.tensor([ids])
    kw = {"assistant_model": assistant} if assistant is not None else {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(x, max_new_tokens=max_tokens, do_sample=False, **kw)
    return time.perf_counter() - t0, y[0, len(ids):].tolist()


def part_pair(args) -> dict[str, Any]:
    import ray

    from workers.models.assets.resolve import resolve_model

    try:
        target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    except Exception as e:  # noqa: BLE001 - report and skip the part
        return {"skipped": f"{e} (run `make qwen-coder` to prepare the Qwen2.5-Coder pair)"}
    # Ray runs worker processes at niceness 15 by default; the target runs in this process at 0. On a
    # busy machine the drafter actor would then yield to every other process and the target would
    # not: both run at 0 here (in `duet serve` both are Ray workers, at the same niceness).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config={"worker_niceness": 0})
    try:
        res = _pair_engine(args, target_path, draft_path)
    finally:
        ray.shutdown()
    gc.collect()
    prompts = res.pop("_prompts")
    if not args.skip_hf:
        res["hf"] = _pair_hf(args, target_path, draft_path, prompts, res["engine_batch1"])
    return res


def _pair_engine(args, target_path: Path, draft_path: Path) -> dict[str, Any]:
    spec_cfg = SpeculativeConfig(method="draft_model", draft_model=str(draft_path), num_speculative_tokens=args.k,
                                 draft_quantization=args.quantization, drafter_cpus=1, draft_timeout_s=30.0,
                                 overlap=args.overlap, draft_vocab_size=args.draft_vocab,
                                 drafter_threads=args.drafter_threads)
    common = dict(kv_cache_memory_bytes=512 << 20, quantization=args.quantization)
    spec = LLM(str(target_path), speculative=spec_cfg, **common)
    ids = [chat(spec.tokenizer, p) for p in CODE_TASKS]
    for speculate in (False, True):
        run_engine(spec, ids[:1], 4, speculate)
    kept = None
    if args.draft_vocab:
        from workers.spec_decode.draft_vocab import draft_token_ids

        kept = set(draft_token_ids(draft_path, spec.engine.spec.vocab_size, args.draft_vocab).tolist())
    res = {"engine_batch1": compare(spec, [[x] for x in ids[: args.pair_prompts]], args.max_tokens,
                                    args.repeats, args.plain_threads, args.target_threads, kept),
           "engine_batch8": compare(spec, [ids], args.max_tokens, 1, args.plain_threads, args.target_threads, kept),
           "drafter": _drafter_stats(spec), "_prompts": ids[: args.pair_prompts]}
    assert spec.engine.speculator is not None  # built with speculation
    spec.engine.speculator.close()
    del spec
    gc.collect()
    return res


def _drafter_stats(llm: LLM) -> dict[str, Any]:
    """The drafter link: calls, time waiting for drafts, and the transport share of it (wall time of
    the gRPC calls minus the drafter's own compute), per call."""
    assert llm.engine.speculator is not None  # built with speculation
    prop = llm.engine.speculator.proposer
    st = prop.stats()
    calls = max(st.calls, 1)
    return {"calls": st.calls, "wait_ms_per_call": round(1e3 * st.seconds / calls, 2),
            # wall time of the calls beyond the drafter's compute: transport + queueing behind an
            # overlapped call still running on the drafter
            "beyond_compute_ms_per_call": round(1e3 * st.extra["transport_seconds"] / calls, 3),
            "empty_call_rtt_ms_median": _rtt_ms(prop),
            "overlap_hits": st.extra["overlap_hits"], "overlap_misses": st.extra["overlap_misses"],
            "fallbacks": st.fallbacks, "policy_fit": _policy_fit(llm)}


def _policy_fit(llm: LLM) -> dict[str, float]:
    """The adaptive policy's cost model at the end: the line through the target's step times, step(n) =
    s0 + s1 n (the policy prices measured row counts from their own medians), and the drafter's wait
    wait(k, n) = f + passes(k) x (p + r n) (workers/engine/draft_length.py DraftCost; ms)."""
    assert llm.engine.speculator is not None  # built with speculation
    pol = llm.engine.speculator.policy
    return {"step_s0_ms": round(1e3 * pol.step.line.a, 2), "step_s1_ms": round(1e3 * pol.step.line.b, 2),
            "draft_wait_f_ms": round(1e3 * pol.draft.f, 2), "draft_pass_p_ms": round(1e3 * pol.draft.p, 2),
            "draft_pass_row_r_ms": round(1e3 * pol.draft.r, 3)}


def _rtt_ms(prop, n: int = 200) -> float:
    """The link's own per-round cost: median round trip of an empty round on the private drafter's stream."""
    link = prop._slots[""].link  # the private drafter's (draft_model.PRIVATE)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        link.send([]).result(timeout=10)
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def _pair_hf(args, target_path: Path, draft_path: Path, prompts: list[list[int]], ours: dict) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    _hf_generate(target, prompts[0], 4)
    plain_rates, assisted_rates, mism = [], [], 0
    for ids in prompts:
        t, a = _hf_generate(target, ids, args.max_tokens)
        plain_rates.append(len(a) / t)
        t, b = _hf_generate(target, ids, args.max_tokens, assistant=draft)
        assisted_rates.append(len(b) / t)
        mism += a != b
    p, s = statistics.median(plain_rates), statistics.median(assisted_rates)
    return {"hf_plain_tokens_per_s": round(p, 2), "hf_assisted_tokens_per_s": round(s, 2),
            "hf_assisted_speedup": round(s / p, 3), "hf_assisted_mismatches": mism,
            "duet_spec_vs_hf_assisted": round(ours["spec_tokens_per_s"] / s, 3),
            "duet_plain_vs_hf_plain": round(ours["plain_tokens_per_s"] / p, 3),
            "note": "HF runs the float32 checkpoints (no quantization)"}


def pair_table(paths: list[Path]) -> str:
    """benchmarks/README.md's pair table, one row per result JSON and batch size."""
    lines = ["| run | batch | plain tok/s | spec tok/s | speedup (paired) | acceptance | tokens / verify | "
             "drafts / verify | in-set share | mismatches | others' load |", "|" + "---|" * 11]
    for path in paths:
        res = json.loads(Path(path).read_text())
        st, pair = res["settings"], res.get("pair") or {}
        name = (f"{Path(path).stem}: target {st['target_threads']}t, drafter {st.get('drafter_threads', 1)}t, "
                f"plain {st.get('plain_threads', 2)}t, overlap {'on' if st.get('overlap', True) else 'off'}, "
                f"vocab {st.get('draft_vocab') or 'full'}")
        for batch in (1, 8):
            r = pair.get(f"engine_batch{batch}")
            if not r:
                continue
            lines.append(f"| {name} | {batch} | {r['plain_tokens_per_s']} | {r['spec_tokens_per_s']} | "
                         f"{r['speedup']:.2f}x ({_paired(r['runs']):.2f}x) | "
                         f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | "
                         f"{r.get('mean_draft_length', 0):.2f} | {r.get('draft_vocab_coverage') or '-'} | "
                         f"{r['greedy_mismatches']} | {', '.join(f'{x:.2f}' for x in r['others_cpu_load'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("ngram", "pair", "all"), default="all")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (most drafts per step)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "q4"),
                    help="pair part: weights of the target and the drafter in our engine")
    ap.add_argument("--target-threads", type=int, default=1, help="pair part: the speculative target's threads")
    ap.add_argument("--plain-threads", type=int, default=2, help="pair part: the plain side's threads")
    ap.add_argument("--drafter-threads", type=int, default=1, help="pair part: the drafter actor's threads")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="pair part: the drafter does not draft ahead while the target verifies (time sharing)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="pair part: the drafter scores only this many most frequent tokens (0 = all)")
    ap.add_argument("--pair-prompts", type=int, default=4, help="pair part: prompts run at batch 1")
    ap.add_argument("--skip-hf", action="store_true", help="pair part: skip the HF transformers columns")
    ap.add_argument("--out", type=Path, default=RESULTS / "spec_bench.json")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSON",
                    help="print benchmarks/README.md's pair table for these result files and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(pair_table(args.table))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res: dict[str, Any] = {"machine": machine_info(), "code": code_version(), "settings": vars(args) | {"out": str(args.out)}}
    if args.part in ("ngram", "all"):
        res["ngram"] = part_ngram(args)
    if args.part in ("pair", "all"):
        res["pair"] = part_pair(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    for part in ("ngram", "pair"):
        for name, row in (res.get(part) or {}).items():
            if isinstance(row, dict) and "speedup" in row:
                print(f"{part:5} {name:18} plain {row['plain_tokens_per_s']:7.2f} tok/s  spec "
                      f"{row['spec_tokens_per_s']:7.2f} tok/s  x{row['speedup']:.2f} (paired x{row['speedup_paired_median']:.2f})  drafts/verify {row['mean_draft_length']:.2f}  acceptance "
                      f"{row['acceptance_rate']:.2f}  tokens/verify {row['mean_accepted_length']:.2f}  "
                      f"mismatches {row['greedy_mismatches']}  load {row['others_cpu_load']}")
    if "drafter" in (res.get("pair") or {}):
        print("pair  drafter", {k: v for k, v in res["pair"]["drafter"].items()})
    if "hf" in (res.get("pair") or {}):
        print("pair  hf", res["pair"]["hf"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
