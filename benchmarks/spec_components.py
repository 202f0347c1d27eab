"""Where a speculative step's time goes, component by component (the pair of spec_bench.py).

- target: a decode step computing M rows (M = 1: plain decoding; M = k + 1: a verify of k drafts,
  run exactly as the engine runs it: one decode row per token through the decode kernel), with the
  LM head over all M rows, at a context of ``--context`` tokens; per thread count.
- drafter: one draft token (a single-row step plus its LM head) with the full head and with pruned
  heads (draft_vocab.py) of ``--draft-vocab`` tokens in int8 and in the drafter's own format.
- heads alone: the LM head's time for one row, per variant.

Every figure is the median over ``--repeats`` timed batches of ``--calls`` calls, each batch gated
on a quiet machine (engine_throughput.QuietGate) and reported with the CPU load others caused.
From these the break-even of speculation follows: a window of k drafts costs
step(k + 1) + k * draft_token (drafter in series) and yields E(k) tokens (adaptive.py).

    python -m benchmarks.spec_components --quantization q4     # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.engine_throughput import QuietGate, code_version, machine_info, quiet_median, record
from workers.config import CacheConfig, EngineConfig
from workers.models.assets.resolve import resolve_model
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.spec_decode.draft_vocab import PrunedHead, draft_token_ids
from workers.spec_decode.drafter import DraftEngine, DraftItem

logger = logging.getLogger("spec_components")
RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str, quantization: str, context: int) -> DraftEngine:
    """A model with one request holding ``context`` tokens of KV (a DraftEngine is the smallest
    thing that owns a model, its KV pool and a request)."""
    engine = DraftEngine(EngineConfig(model=name, quantization=quantization,
                                      cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
    engine.propose([DraftItem("r", 0, [1000 + i % 5000 for i in range(context)], 0,
                              SamplingParams(temperature=0.0, max_tokens=1))])
    return engine


def step_fn(engine: DraftEngine, rows: int, head: Callable[[torch.Tensor], Any]):
    """A function running one step over ``rows`` rows after the held context (the last held token
    and rows - 1 drafts, as a verify chunk), then ``head`` over every row."""
    seq = engine._seqs["r"]
    start = seq.num_computed_tokens
    del seq.token_ids[start + 1 :]
    seq.token_ids.extend(2000 + i for i in range(rows - 1))
    engine.block_manager.allocate(seq, rows)
    chunk = ScheduledChunk("r", seq.token_ids[start:], start, list(engine.block_manager.block_table("r")),
                           sample=True, num_draft=rows - 1)

    @torch.inference_mode()
    def run() -> None:
        hidden, sampled = engine.runner.forward(SchedulerOutput([chunk]))  # rewrites the same KV slots
        head(hidden[[r for r, _ in sampled]])
    return run


def head_fn(head: Callable[[torch.Tensor], Any], hidden_size: int):
    x = torch.randn(1, hidden_size)  # [1, E]

    @torch.inference_mode()
    def run() -> None:
        head(x)
    return run


def timed(gate: QuietGate, fn, calls: int, repeats: int) -> dict[str, Any]:
    fn()  # warm-up
    d: dict[str, Any] = {}
    for _ in range(repeats):
        record(d, "ms", gate.time(lambda: [fn() for _ in range(calls)]), 1e3 / calls)
    return {"ms": round(quiet_median(d["ms"], d["ms_load"]), 2), "others_cpu_load": round(statistics.median(d["ms_load"]), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--draft", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--quantization", default="q4", choices=("none", "int8", "q4"))
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts to time")
    ap.add_argument("--rows", default="1,2,3,4,5,7,9", help="target step sizes M (1 = plain decode)")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="pruned drafter head size")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quiet-budget", type=float, default=300.0,
                    help="seconds the run may spend waiting for a quiet machine and redoing contended timings")
    ap.add_argument("--out", type=Path, default=RESULTS / "spec_components.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    gate = QuietGate(budget_s=args.quiet_budget)
    res: dict[str, Any] = {"machine": machine_info(), "code": code_version(), "settings": vars(args) | {"out": str(args.out)}}
    threads = [int(t) for t in args.threads.split(",")]

    target = load(args.target, args.quantization, args.context)
    rows = [int(m) for m in args.rows.split(",")]
    for t in threads:
        torch.set_num_threads(t)
        res[f"target_threads{t}"] = {f"step_M{m}": timed(gate, step_fn(target, m, target.runner.model.compute_logits),
                                                         args.calls, args.repeats) for m in rows}
        logger.info("target %d threads: %s", t, {k: v["ms"] for k, v in res[f"target_threads{t}"].items()})
    del target

    draft = load(args.draft, args.quantization, args.context)
    model = draft.runner.model
    ids = draft_token_ids(resolve_model(args.draft), draft.vocab_size, args.draft_vocab)
    heads: dict[str, Callable[[torch.Tensor], Any]] = {"full": model.compute_logits,
                                                       "pruned_int8": PrunedHead(model, ids, "int8")}
    if args.quantization not in ("int8",):
        heads[f"pruned_{args.quantization}"] = PrunedHead(model, ids, args.quantization)
    for t in threads:
        torch.set_num_threads(t)
        row: dict[str, Any] = {}
        for name, head in heads.items():
            row[f"draft_token_{name}"] = timed(gate, step_fn(draft, 1, head), args.calls, args.repeats)
            row[f"head_{name}"] = timed(gate, head_fn(head, draft.spec.hidden_size), args.calls, args.repeats)
        res[f"drafter_threads{t}"] = row
        logger.info("drafter %d threads: %s", t, {k: v["ms"] for k, v in row.items()})
    res["gate_seconds_spent"] = round(gate.spent_s, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
