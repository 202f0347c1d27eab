#!/usr/bin/env python
"""Qwen2.5-Coder loading check: Duet's engine against HF transformers on the same checkpoint, as JSON.

Run from the repository root (needs `make qwen-coder` first; ~2 min for 0.5B, ~8 min for 1.5B on 2 cores)::

    .venv/bin/python benchmarks/qwen_check.py                                  # both models
    .venv/bin/python benchmarks/qwen_check.py --model Qwen2.5-Coder-0.5B-Instruct --new-tokens 16

What is compared, per model, on a few coding requests in the model's chat template (greedy, batch 1):
    engine_vs_hf     Duet's engine (fp32, ``EngineConfig(model=NAME)``) generates the same tokens as HF
                     ``generate(do_sample=False)`` on the converted checkpoint: per prompt, equal or
                     the index of the first difference.
    logits_vs_hf     teacher-forced on prompt + HF's continuation: max |logit difference| between
                     Duet's model and HF's, and how often their argmax agrees (a near-tie may flip).
    quantized        for each of ``--quant`` (int8, q4): teacher-forced top-1 agreement with Duet
                     fp32 over the same positions, and the engine's free-running greedy tokens:
                     the share of positions before the first divergence from fp32.
Models are loaded one at a time (HF, then Duet fp32, then each quantized model) to bound memory.
Exit status 1 if fp32 tokens differ from HF on any prompt (a loader bug), else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from workers.llm import LLM  # noqa: E402
from workers.models.assets.resolve import resolve_model  # noqa: E402
from workers.models.loader import load_model  # noqa: E402
from workers.models.scoring import next_token_logits  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("qwen_check")
MODELS = ["Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"]
REQUESTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) + 1",
    "Write a SQL query that counts orders per customer in a table orders(id, customer_id).",
    "Explain what this does in one sentence: [x * x for x in range(10) if x % 2 == 0]",
]


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for r in REQUESTS]


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def hf_side(path: Path, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """HF greedy continuations, and HF's teacher-forced logits on prompt + continuation ([L - 1, V] each)."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    outs, logits = [], []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0].tolist()
        outs.append(out[len(ids):])
        logits.append(model(torch.tensor([out[:-1]])).logits[0].float())  # [L - 1, V]
    del model
    gc.collect()
    return outs, logits, load_s


def engine_greedy(path: Path, prompts: list[list[int]], n: int, quantization: str) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    llm = LLM(str(path), quantization=quantization, kv_cache_memory_bytes=256 << 20)
    load_s = time.perf_counter() - t0
    assert next(llm.engine.runner.model.parameters()).dtype == torch.float32
    outs = [llm.generate(ids, SamplingParams(temperature=0, max_tokens=n))[0].token_ids for ids in prompts]
    del llm
    gc.collect()
    return outs, load_s


def teacher_forced(path: Path, seqs: list[list[int]], quantization: str) -> list[torch.Tensor]:
    model, spec = load_model(path, torch.float32, quantization=quantization)
    logits = [next_token_logits(model, spec, ids) for ids in seqs]  # [L - 1, V] each
    del model
    gc.collect()
    return logits


def check_model(name: str, n: int, quants: list[str]) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.perf_counter()
    path = resolve_model(name)
    resolve_s = time.perf_counter() - t0
    cfg = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tokenizer)
    logger.info("%s: HF reference on %d prompts", name, len(prompts))
    hf_out, hf_logits, hf_load_s = hf_side(path, prompts, n)
    seqs = [p + o for p, o in zip(prompts, hf_out)]
    logger.info("%s: Duet fp32", name)
    duet_out, duet_load_s = engine_greedy(path, prompts, n, "none")
    ours = teacher_forced(path, seqs, "none")
    mismatches = [first_mismatch(d, h) for d, h in zip(duet_out, hf_out)]
    max_diff = max((a - b).abs().max().item() for a, b in zip(ours, hf_logits))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, hf_logits))
    positions = sum(a.shape[0] for a in ours)
    result: dict[str, Any] = {
        "model": name, "checkpoint": str(path),
        "checkpoint_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "config": {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads",
                                                      "tie_word_embeddings", "use_sliding_window", "max_window_layers")}
                  | {"rope_theta": (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")},
        "resolve_s": round(resolve_s, 2), "hf_load_s": round(hf_load_s, 2), "duet_load_s": round(duet_load_s, 2),
        "prompts": [{"request": r, "prompt_tokens": len(p), "hf_tokens": len(h), "first_mismatch": m,
                     "hf_text": tokenizer.decode(h, skip_special_tokens=True)}
                    for r, p, h, m in zip(REQUESTS, prompts, hf_out, mismatches)],
        "engine_vs_hf": {"prompts_equal": sum(m is None for m in mismatches), "prompts": len(prompts)},
        "logits_vs_hf": {"max_abs_diff": max_diff, "top1_agreement": agree / positions, "positions": positions},
        "quantized": {},
    }
    for q in quants:
        logger.info("%s: Duet %s", name, q)
        q_logits = teacher_forced(path, seqs, q)
        q_agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(q_logits, ours))
        q_out, _ = engine_greedy(path, prompts, n, q)
        before = [first_mismatch(a, b) for a, b in zip(q_out, duet_out)]
        matched = sum(len(b) if m is None else m for m, b in zip(before, duet_out))
        result["quantized"][q] = {"top1_agreement_vs_fp32": q_agree / positions, "positions": positions,
                                  "greedy_prefix_share": matched / sum(len(b) for b in duet_out),
                                  "greedy_prompts_equal": sum(m is None for m in before)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help=f"repeatable; default: {', '.join(MODELS)}")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    parser.add_argument("--quant", default="int8,q4", help="comma-separated quantizations to compare ('' for none)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "qwen_check.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    quants = [q for q in args.quant.split(",") if q]
    results = [check_model(m, args.new_tokens, quants) for m in args.model or MODELS]
    report = {"created": datetime.now(UTC).isoformat(timespec="seconds"), "new_tokens": args.new_tokens,
              "torch_threads": args.threads, "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(f"{r['model']}: engine == HF on {r['engine_vs_hf']['prompts_equal']}/{r['engine_vs_hf']['prompts']} "
              f"prompts; logits max |diff| {r['logits_vs_hf']['max_abs_diff']:.2e}, top-1 agreement "
              f"{r['logits_vs_hf']['top1_agreement']:.1%}")
        for q, v in r["quantized"].items():
            print(f"  {q}: top-1 vs fp32 {v['top1_agreement_vs_fp32']:.1%} of {v['positions']} positions; greedy "
                  f"prefix {v['greedy_prefix_share']:.1%}, {v['greedy_prompts_equal']} prompts equal")
    print(f"wrote {args.out}")
    return 0 if all(r["engine_vs_hf"]["prompts_equal"] == r["engine_vs_hf"]["prompts"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
