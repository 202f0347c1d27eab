"""Structured output on the device (workers/structured/): llguidance masks (computed on the host)
applied to the device's logits in the sampler. Checks: sampled JSON-schema / regex / choice outputs
(temperature 1, batch 8) are valid; greedy constrained output is identical with n-gram speculative
decoding (per-position masks in verification). Figures: decode tok/s of constrained vs free
requests at batch 1 and 16 (target >= 0.9x), SmolLM2-135M shape, random weights, bf16 on CUDA
(fp32 on CPU). Needs the llguidance wheel on a bare machine (``make gpu-wheels``)."""

from __future__ import annotations

from typing import Any
import json
import re
import shutil
import time

from benchmarks.gpu_check import common, models

CUDA_ONLY = False
BUDGET_S = 60.0
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "b", "c"]},
                         "name": {"type": "string", "maxLength": 8}}}
LONG = {"type": "array", "minItems": 64, "items": {"type": "object", "required": ["k", "v"], "additionalProperties": False,
                                                  "properties": {"k": {"type": "integer"}, "v": {"type": "string"}}}}
REGEX = r"[a-z]{2,6}-[0-9]{2,4}"
EOS = 257  # a filler id of the generated tokenizer (ids < 256 are bytes)


def _valid(obj: object) -> bool:
    """SCHEMA, checked by hand (jsonschema is not on a bare machine)."""
    return (isinstance(obj, dict) and set(obj) <= {"id", "tag", "name"} and {"id", "tag"} <= set(obj)
            and isinstance(obj["id"], int) and 0 <= obj["id"] <= 999 and obj["tag"] in ("a", "b", "c")
            and len(obj.get("name", "")) <= 8)


def _checkpoint(ctx, dtype):
    """The SmolLM2-shaped checkpoint with EOS moved off the byte ids: the shared one's EOS (id 1) is
    also a byte of the generated tokenizer, which a grammar would then allow as text."""
    base = common.checkpoint(ctx, "smollm2-135m", dtype)
    out = base.parent / f"{base.name}-eos{EOS}"
    if not (out / "done").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(base, out)
        for name in ("config.json", "generation_config.json"):
            f = out / name
            if f.exists():
                cfg = json.loads(f.read_text())
                cfg.update(eos_token_id=EOS, pad_token_id=EOS)
                f.write_text(json.dumps(cfg))
    return out


def _run(eng, prompts, params) -> list:
    outs: dict[str, Any] = {}
    ids = [eng.add_request(f"s{time.monotonic_ns()}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while eng.has_unfinished():
        for o in eng.step():
            d = outs.setdefault(o.request_id, {"ids": [], "text": "", "error": None, "finish": None})
            d["ids"] += o.new_token_ids
            d["text"] += o.new_text
            d["finish"] = o.finish_reason
            d["error"] = o.error
    return [outs[r] for r in ids]


def _rate(eng, ctx, prompts, params) -> float:
    common.sync(ctx)
    t0 = time.perf_counter()
    outs = _run(eng, prompts, params)
    common.sync(ctx)
    return sum(len(o["ids"]) for o in outs) / (time.perf_counter() - t0)


def run(ctx) -> dict:
    from workers.config import SpeculativeConfig
    from workers.sampling_params import SamplingParams
    from workers.structured.spec import StructuredOutput

    dtype = common.dtype_for(ctx)
    path = _checkpoint(ctx, dtype)
    eng = common.engine(path, ctx, dtype)
    prompts = models.prompts(16, eng.spec.vocab_size, 10, 30, seed=23)
    kinds = [StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("regex", REGEX),
             StructuredOutput("choice", choices=("left", "right", "up"))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured=kinds[i % 3]) for i in range(9)]
    outs = _run(eng, prompts[:9], params)
    ok = []
    for i, o in enumerate(outs):
        ids = o["ids"][:-1] if o["ids"][-1:] == [EOS] else o["ids"]  # the filler EOS is not a special token
        text, kind = eng.tokenizer.decode(ids), i % 3
        if o["error"] is not None or o["finish"] is None or o["finish"].value != "stop":
            ok.append(False)
        elif kind == 0:
            try:
                ok.append(_valid(json.loads(text)))
            except ValueError:
                ok.append(False)
        else:
            ok.append(bool(re.fullmatch(REGEX, text)) if kind == 1 else text in ("left", "right", "up"))
    out: dict[str, Any] = {"valid_outputs": f"{sum(ok)}/{len(ok)}", "tok_s": {}}
    n = 16 if ctx.tiny else 64
    long = StructuredOutput("json_schema", json.dumps(LONG))
    for batch in (1, 16):
        free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i in range(batch)]
        cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, structured=long) for i in range(batch)]
        _rate(eng, ctx, prompts[:batch], cons)  # warm-up (and the compile)
        f = [_rate(eng, ctx, prompts[:batch], free) for _ in range(3)]
        c = [_rate(eng, ctx, prompts[:batch], cons) for _ in range(3)]
        fm, cm = sorted(f)[1], sorted(c)[1]
        out["tok_s"][f"batch{batch}"] = {"free": round(fm, 1), "constrained": round(cm, 1), "ratio": round(cm / fm, 3)}
    greedy = [SamplingParams(temperature=0.0, max_tokens=32, structured=kinds[i % 3]) for i in range(6)]
    want = [o["ids"] for o in _run(eng, prompts[:6], greedy)]
    del eng
    spec = common.engine(path, ctx, dtype, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                         adaptive=False))
    got = [o["ids"] for o in _run(spec, prompts[:6], greedy)]
    out["spec_verifies"] = spec.stats().spec.num_verifies
    r = {k: v["ratio"] for k, v in out["tok_s"].items()}
    out["targets"] = {"constrained_ge_0.9x_free": {"measured": r, "met": all(v >= 0.9 for v in r.values())}}
    out["checks"] = {"outputs_valid": all(ok), "spec_identical": got == want}
    out["summary"] = (f"valid {out['valid_outputs']}; constrained/free tok/s " +
                      ", ".join(f"b{k[5:]} {v['constrained']:.0f}/{v['free']:.0f} ({v['ratio']}x)"
                                for k, v in out["tok_s"].items()) + f"; spec identical {got == want}")
    return out
