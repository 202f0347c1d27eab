"""Batched LoRA benchmark (issue 35), in one run on the embedded SmolLM2-135M:

1. decode throughput and TTFT of one batch of ``--batch`` requests spread over N adapters
   (N = 1, 4, 16; request i runs adapter i mod N) served together by one engine (batched LoRA:
   kernels/lora.py on shared base weights), vs
   - the base model alone: the same batch with no adapter (the fused decode stack runs), and
   - one merged model per adapter: for each adapter, its requests run as their own batch on the
     base engine whose weights were replaced in place by W + scale B A (PEFT's merge), one adapter
     after another on the same cores (what a deployment without batched LoRA does with N replicas
     sharing a machine). Merging is not timed; only the generation of each adapter's batch is.
   Every request generates exactly ``--max-tokens`` tokens (greedy, ignore_eos), so all sides do
   the same work. Runs alternate per repeat; medians are reported with the CPU load other
   processes caused (CpuLoadMeter).
2. adapter load time: read + validate + place into a slot (AdapterSet.load), median over the adapters.
3. ``--spec``: what an adapter costs speculative decoding whose drafter runs the base model only
   (an int8 SmolLM2 draft engine in this process, 4 drafts a round, adaptive length off): the
   acceptance rate of the same chat prompts run under no adapter and under each adapter, with the
   share of greedy tokens each adapter changes against the base model (how far it moves the model:
   random adapters of ``--spec-b-std`` stand in for fine-tunes, which move it by their own amount).

The adapters are random PEFT LoRAs of rank ``--rank``, written with peft into a temporary directory,
for each ``--targets`` set: ``qv`` (q_proj + v_proj, PEFT's default for Llama models) and ``all``
(all seven projections: the most work per token).

    nice -n 10 python benchmarks/lora_bench.py            # ~5 min on 2 quiet cores

Writes benchmarks/results/lora_bench.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.engine_throughput import CpuLoadMeter, code_version, machine_info  # noqa: E402
from workers.config import LoraConfig  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.lora.reader import read_adapter  # noqa: E402
from workers.lora.targets import PEFT_MODULES  # noqa: E402
from workers.models.assets.prepare import prepare_smollm2  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("lora_bench")
RESULTS = REPO_ROOT / "benchmarks" / "results"
ALL_MODULES = list(PEFT_MODULES)


TARGET_SETS = {"qv": ["q_proj", "v_proj"], "all": ALL_MODULES}


def make_adapters(base: Path, out: Path, n: int, rank: int, targets: list[str], b_std: float = 0.02) -> list[Path]:
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * b_std)
        peft_model.save_pretrained(str(out / f"a{i}"))
        paths.append(out / f"a{i}")
    return paths


def timed_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                adapters: list[str]) -> tuple[float, int, list[float]]:
    """(seconds, generated tokens, TTFT of each request in seconds): the whole batch added at once."""
    engine = llm.engine
    t0 = time.perf_counter()
    rids = [engine.add_request(None, p, params, adapter=a) for p, a in zip(prompts, adapters)]
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    return time.perf_counter() - t0, tokens, [first[r] for r in rids]


class MergedWeights:
    """Swap an adapter's merged weights (W + scale B A) into the engine's model in place, and back."""

    def __init__(self, llm: LLM) -> None:
        self.model = llm.engine.runner.model
        self.targets = self.model.lora_targets()
        self.params = dict(self.model.named_parameters())
        self.original = {n: p.detach().clone() for n, p in self.params.items() if n.endswith("_proj.weight")}

    def _param(self, layer: int, module: str) -> tuple[torch.Tensor, int]:
        projection, part = PEFT_MODULES[module]
        kind = "self_attn" if projection in ("qkv", "o") else "mlp"
        name = f"model.layers.{layer}.{kind}.{ {'qkv': 'qkv_proj', 'o': 'o_proj', 'gate_up': 'gate_up_proj', 'down': 'down_proj'}[projection]}.weight"
        return self.params[name], self.targets[layer][projection].part(part)[0]

    def merge(self, source: Path) -> None:
        self.restore()
        adapter = read_adapter("merge", str(source), self.targets, 256)
        with torch.no_grad():
            for (layer, module), (a, b) in adapter.weights.items():
                w, start = self._param(layer, module)
                rows = w[start: start + b.shape[0]]
                rows.copy_((rows.float() + adapter.scale * (b @ a)).to(w.dtype))
        self._repack()

    def restore(self) -> None:
        with torch.no_grad():
            for n, t in self.original.items():
                self.params[n].copy_(t)
        self._repack()

    def _repack(self) -> None:
        """Layers that keep a oneDNN-packed copy of their weight (EngineConfig.prepack_weights) re-pack it."""
        for m in self.model.modules():
            if getattr(m, "packed", None) is not None:
                m.prepack()


def run_set(base: Path, targets: str, args: argparse.Namespace) -> dict[str, Any]:
    """Section 1 and 2 of the module docstring for one target set."""
    n_max = max(args.adapters)
    tmp = tempfile.TemporaryDirectory(prefix="lora_bench_")
    paths = make_adapters(base, Path(tmp.name), n_max, args.rank, TARGET_SETS[targets])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(str(base), dtype=args.dtype, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
              max_num_seqs=max(args.batch, 16), lora=LoraConfig(enabled=True, max_loaded=n_max, max_rank=args.rank))
    load_s = []
    for i, p in enumerate(paths):
        t0 = time.perf_counter()
        llm.load_adapter(f"a{i}", str(p))
        load_s.append(time.perf_counter() - t0)
    merged = MergedWeights(llm)
    timed_batch(llm, prompts[:2], params, ["", "a0"])  # warm-up: both paths' first calls

    runs: dict[str, list[dict[str, float]]] = {}

    def record(name: str, seconds: float, tokens: int, ttft: list[float]) -> None:
        runs.setdefault(name, []).append({"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                                          "ttft_median_s": statistics.median(ttft)})

    meter = CpuLoadMeter()
    for rep in range(args.repeats):
        record("base", *timed_batch(llm, prompts, params, [""] * args.batch))
        for n in args.adapters:
            names = [f"a{i % n}" for i in range(args.batch)]
            record(f"batched_{n}", *timed_batch(llm, prompts, params, names))
            if args.skip_merged:
                continue
            seconds, tokens, ttft = 0.0, 0, []
            for a in range(n):  # one merged model per adapter, its requests as one batch, one after another
                mine = [p for i, p in enumerate(prompts) if i % n == a]
                merged.merge(paths[a])
                s, t, f = timed_batch(llm, mine, params, [""] * len(mine))
                ttft += [seconds + x for x in f]  # a later adapter's requests waited for the earlier batches
                seconds, tokens = seconds + s, tokens + t
            merged.restore()
            record(f"merged_{n}", seconds, tokens, ttft)
        logger.warning("%s: repeat %d done", targets, rep + 1)
    load = meter.read()
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {"tok_s_median": statistics.median(r["tok_s"] for r in rs),
                         "ttft_median_s": statistics.median(r["ttft_median_s"] for r in rs), "runs": rs}
    base_tok_s = summary["base"]["tok_s_median"]
    for s in summary.values():
        s["vs_base"] = s["tok_s_median"] / base_tok_s
    for n in [] if args.skip_merged else args.adapters:
        summary[f"batched_{n}"]["vs_merged"] = summary[f"batched_{n}"]["tok_s_median"] / \
            summary[f"merged_{n}"]["tok_s_median"]
    adapters = llm.engine.adapters
    assert adapters is not None  # the engine was built with lora enabled
    info = adapters.list()
    return {"targets": TARGET_SETS[targets], "others_cpu_share": load, "engine_dtype": str(llm.engine.config.torch_dtype),
            "adapter_bytes": info[0].bytes, "slots_bytes": adapters.stacks.nbytes,
            "adapter_load_s": {"median": statistics.median(load_s), "max": max(load_s), "all": load_s},
            "results": summary}


SPEC_PROMPTS = [
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList the planets of the solar system in order.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a hash table is in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nTranslate 'good morning, how are you?' into French.<|im_end|>\n<|im_start|>assistant\n",
]


def spec_acceptance(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Section 3 of the module docstring."""
    from workers.config import CacheConfig, EngineConfig, SpeculativeConfig
    from workers.spec_decode.draft_model import DraftModelProposer
    from workers.spec_decode.drafter import DraftEngine
    from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

    tmp = tempfile.TemporaryDirectory(prefix="lora_spec_")
    rows: dict[str, Any] = {}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(str(base), dtype="float32", kv_cache_memory_bytes=64 << 20,
                lora=LoraConfig(enabled=True, max_loaded=4, max_rank=args.rank))
    draft = DraftEngine(EngineConfig(model=str(base), quantization="int8",
                                     cache=CacheConfig(kv_cache_memory_bytes=32 << 20)))
    server, endpoint = serve_drafter(draft)
    try:
        spec = SpeculativeConfig(method="draft_model", draft_model=str(base), num_speculative_tokens=4, adaptive=False)
        llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=64 << 20, speculative=spec,
                  proposer=DraftModelProposer(endpoint_connector(endpoint)),
                  lora=LoraConfig(enabled=True, max_loaded=4, max_rank=args.rank))
        base_tokens = [c.token_ids for c in plain.generate(SPEC_PROMPTS, params)]
        for targets in args.targets:
            paths = make_adapters(base, Path(tmp.name) / targets, 3, args.rank, TARGET_SETS[targets],
                                  b_std=args.spec_b_std)
            for i, p in enumerate(paths):
                name = f"{targets}{i}"
                plain.load_adapter(name, str(p))
                llm.load_adapter(name, str(p))
            for name in ["", *(f"{targets}{i}" for i in range(len(paths)))]:
                if name in rows:
                    continue
                before = llm.engine.stats().spec
                outs = [c.token_ids for c in llm.generate(SPEC_PROMPTS, params, adapters=name)]
                after = llm.engine.stats().spec
                want = [c.token_ids for c in plain.generate(SPEC_PROMPTS, params, adapters=name)]
                drafted = after.num_draft_tokens - before.num_draft_tokens
                changed = sum(a != b for o, bo in zip(want, base_tokens) for a, b in zip(o, bo))
                rows[name or "base"] = {
                    "acceptance": (after.num_accepted_tokens - before.num_accepted_tokens) / max(drafted, 1),
                    "draft_tokens": drafted, "identical_to_plain": outs == want,
                    "tokens_changed_vs_base": changed / sum(len(o) for o in want)}
    finally:
        server.stop(grace=0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--targets", nargs="+", default=["qv", "all"], choices=sorted(TARGET_SETS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 on AMX / AVX512-BF16 CPUs)")
    ap.add_argument("--spec", action="store_true", help="also section 3: the base drafter's acceptance under adapters")
    ap.add_argument("--spec-b-std", type=float, default=0.05, help="section 3's adapters: lora_B's random scale")
    ap.add_argument("--skip-throughput", action="store_true", help="only sections 2 and 3")
    ap.add_argument("--skip-merged", action="store_true", help="no merged-model runs (batched vs base only)")
    ap.add_argument("--also-per-part", action="store_true",
                    help="also run each target set with the per-token kernel off (ROWS_MAX_TOKEN_RANKS = 0: one "
                    "dense / grouped call per part, the form before kernels/csrc/lora.cpp), right after it")
    ap.add_argument("--out", type=Path, default=RESULTS / "lora_bench.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = prepare_smollm2()
    sets = {}
    for t in [] if args.skip_throughput else args.targets:
        sets[t] = run_set(base, t, args)
        if args.also_per_part:
            import kernels.lora

            kept, kernels.lora.ROWS_MAX_TOKEN_RANKS = kernels.lora.ROWS_MAX_TOKEN_RANKS, 0
            try:
                sets[f"{t}/per-part"] = run_set(base, t, args)
            finally:
                kernels.lora.ROWS_MAX_TOKEN_RANKS = kept
    spec = spec_acceptance(base, args) if args.spec else None
    result = {
        "benchmark": "lora_bench", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
        "code": code_version(), "loadavg_1m_end": os.getloadavg()[0],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target_sets": sets, "spec_acceptance": spec,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for t, r in sets.items():
        print(f"\n[{t}: {', '.join(r['targets'])}] engine dtype {r['engine_dtype']}, batch {args.batch}, "
              f"{args.max_tokens} tokens each, rank {args.rank}; others' CPU share {r['others_cpu_share']:.0%}")
        print(f"{'config':<12} {'tok/s':>8} {'vs base':>8} {'vs merged':>10} {'TTFT med':>9}")
        for name, s in r["results"].items():
            vm = f"{s['vs_merged']:.2f}x" if "vs_merged" in s else ""
            print(f"{name:<12} {s['tok_s_median']:8.1f} {s['vs_base']:7.2f}x {vm:>10} "
                  f"{s['ttft_median_s'] * 1e3:7.0f}ms")
        print(f"adapter load: median {r['adapter_load_s']['median'] * 1e3:.0f} ms, max "
              f"{r['adapter_load_s']['max'] * 1e3:.0f} ms ({r['adapter_bytes'] / 1e6:.1f} MB each)")
    if spec is not None:
        print(f"\nbase-model drafter (int8), 4 drafts a round, fp32 target; adapters b_std {args.spec_b_std}")
        for name, r in spec.items():
            print(f"{name:<8} acceptance {r['acceptance']:.3f} ({r['draft_tokens']} drafted), greedy tokens changed vs "
                  f"base {r['tokens_changed_vs_base']:.0%}, identical to plain: {r['identical_to_plain']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
