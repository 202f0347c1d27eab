#!/usr/bin/env python
"""Teacher-forced agreement and perplexity of each CPU dtype vs float32 (bf16, int8 and q4 with int8 activations).

Run from the repository root::

    .venv/bin/python benchmarks/quality_vs_fp32.py          # SmolLM2-135M-Instruct on tests/data/public_domain_sample.txt

For each variant the model scores the sample as one teacher-forced prefill (workers/models/scoring.py,
the model's own CPU kernels: bf16 through the bf16 kernels and oneDNN, int8 / q4 through the
int8-activation kernels, whose LM head is int8 too):

    perplexity         exp(-mean log p(next token)) over the sample's L - 1 predicted tokens
    top1_agreement     share of positions where the variant's argmax equals fp32's
    max_abs_logit_diff largest |logit - fp32 logit| over all positions and the vocabulary
    mean_kl            mean over positions of KL(fp32 || variant) of the next-token distributions

JSON (benchmarks/results/quality_vs_fp32.json) with the machine, the kernel paths and the commit.
The bounds the tests hold these to: tests/workers/models/test_quant_model.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import code_version, machine_info  # noqa: E402
from kernels import _build  # noqa: E402
from kernels.cpu_features import features  # noqa: E402
from workers.models.assets.prepare import prepare_smollm2  # noqa: E402
from workers.models.loader import load_model  # noqa: E402
from workers.models.scoring import next_token_logits  # noqa: E402

SAMPLE = REPO_ROOT / "tests" / "data" / "public_domain_sample.txt"
# name: (activations, quantization, KV cache dtype; None = the activations'). int8 / q4 score with the
# bf16 KV cache an engine gives them on CPU (cache.kv_cache_dtype: auto), and with an fp32 one.
VARIANTS = {"fp32": (torch.float32, "none", None), "bf16": (torch.bfloat16, "none", None),
            "fp32+kv_bf16": (torch.float32, "none", torch.bfloat16),
            "int8": (torch.float32, "int8", torch.bfloat16), "int8+kv_fp32": (torch.float32, "int8", None),
            "q4": (torch.float32, "q4", torch.bfloat16), "q4+kv_fp32": (torch.float32, "q4", None)}


@torch.inference_mode()
def run(threads: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    path = prepare_smollm2()
    ids = AutoTokenizer.from_pretrained(path).encode(SAMPLE.read_text())
    target = torch.tensor(ids[1:])
    logp: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, (dtype, quant, kv_dtype) in VARIANTS.items():
        model, spec = load_model(path, dtype, quantization=quant)
        logp[name] = torch.log_softmax(next_token_logits(model, spec, ids, kv_dtype=kv_dtype).double(), dim=-1)
        del model
        nll = -logp[name].gather(1, target[:, None]).mean().item()
        row: dict[str, Any] = {"perplexity": math.exp(nll)}
        if name != "fp32":
            ref = logp["fp32"]
            row["top1_agreement"] = (logp[name].argmax(-1) == ref.argmax(-1)).double().mean().item()
            # log-softmax differs from the logits by a per-row constant: compare logits through it
            d = (logp[name] - ref)
            row["max_abs_logit_diff"] = (d - d.mean(-1, keepdim=True)).abs().max().item()
            row["mean_kl"] = (ref.exp() * (ref - logp[name])).sum(-1).mean().item()
        out[name] = row
        print(f"{name:5} " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    ext = _build.ext()
    return {
        "benchmark": "quality_vs_fp32",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": path.name, "sample": str(SAMPLE.relative_to(REPO_ROOT)), "positions": len(ids) - 1,
        "threads": threads,
        "kernel_paths": None if ext is None else {"isa": ext.active_isa(), "bf16_gemv_native": ext.gemv_bf16_native(),
                                                 "quant": ext.quant_path()},
        "cpu_features": vars(features()), "loadavg": os.getloadavg(),
        "machine": machine_info(), "code": code_version(), "variants": out,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "quality_vs_fp32.json")
    args = parser.parse_args(argv)
    res = run(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
