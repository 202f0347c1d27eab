"""Rank functions for the quantized tensor-parallel tests (module-level so spawned ranks import them).

Layer shapes (``quant_full_weights``): x [5, 96] (96 = 1.5 chunks); fused q/k/v of 9 query heads and
3 kv heads of 32 (rank 0: 6 + 2 heads, rank 1: 3 + 1, GQA groups whole); o_proj in = 288 split at
192; fused gate/up of width 192 and down_proj in = 192 split at 96 (a block boundary in the middle
of a 64-column chunk: the GGUF-shaped shard is re-packed); an 11-row vocabulary (6 + 5 rows)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from testkit.ep_cases import generate
from kernels.linear import linear
from testkit.mixtral_tiny import prefill_logits
from testkit.tp_cases import make_runner, run_gang
from workers.errors import ConfigError
from workers.layers.quant_linear import QuantLinear, quantize
from workers.layers.quant_parallel import (
    QuantMergedColumnParallelLinear,
    QuantParallelLMHead,
    QuantRowParallelLinear,
)
from workers.layers.vocab_parallel import VocabParallelEmbedding
from workers.models.config import ModelSpec
from workers.models.llama import LlamaForCausalLM
from workers.parallel.groups import get_group
from workers.parallel.sharding import attention_shard, even_shard

HEAD_DIM, HEADS, KV_HEADS, HIDDEN, WIDTH, VOCAB = 32, 9, 3, 96, 192, 11


def quant_full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {"x": r(5, HIDDEN), "q": r(q, HIDDEN), "k": r(kv, HIDDEN), "v": r(kv, HIDDEN), "q_b": r(q), "k_b": r(kv),
            "v_b": r(kv), "o": r(HIDDEN, q), "o_in": r(5, q), "gate": r(WIDTH, HIDDEN), "up": r(WIDTH, HIDDEN),
            "down": r(HIDDEN, WIDTH), "down_in": r(5, WIDTH), "down_b": r(HIDDEN), "emb": r(VOCAB, HIDDEN),
            "head": r(VOCAB, HIDDEN)}


def _buffers(layer) -> dict:
    """A layer's quantized buffers and its bias, if any, as numpy arrays."""
    return {n: t.numpy().copy() for n, t in (*layer.named_buffers(), *layer.named_parameters())}


def _sharded_layers(method: str, w: dict, source: str) -> dict:
    """This rank's quantized layers loaded from float tensors ('float') or QuantizedWeights ('quantized',
    as a GGUF's 4-bit tensors arrive), their outputs and buffers."""
    tp = get_group("tp")
    load = (lambda t: t) if source == "float" else (lambda t: quantize(method, t))
    heads = attention_shard(HEADS, KV_HEADS, tp.world_size, tp.rank)
    q, kv = heads.q_heads.scaled(HEAD_DIM), heads.kv_heads.scaled(HEAD_DIM)
    qkv = QuantMergedColumnParallelLinear(HIDDEN, {"q": q, "k": kv, "v": kv}, True, method)
    for s in ("q", "k", "v"):
        qkv.load_weight(load(w[s]), s)
        qkv.weight_loader(qkv.bias, w[s + "_b"], s)
    o = QuantRowParallelLinear(HEADS * HEAD_DIM, HIDDEN, False, method, shard=q)
    o.load_weight(load(w["o"]))
    i = even_shard(WIDTH, tp.world_size, tp.rank)
    gate_up = QuantMergedColumnParallelLinear(HIDDEN, {"gate": i, "up": i}, False, method)
    for s in ("gate", "up"):
        gate_up.load_weight(load(w[s]), s)
    down = QuantRowParallelLinear(WIDTH, HIDDEN, True, method)
    down.load_weight(load(w["down"]))
    down.weight_loader(down.bias, w["down_b"])
    x = w["x"]
    return {"qkv": qkv(x).numpy(), "o": o(w["o_in"][:, q.start : q.end]).numpy(), "gate_up": gate_up(x).numpy(),
            "down": down(w["down_in"][:, i.start : i.end]).numpy(),
            "buffers": {n: _buffers(m) for n, m in (("qkv", qkv), ("o", o), ("gate_up", gate_up), ("down", down))}}


def _heads(w: dict) -> dict:
    """Untied int8 head from a float tensor and from a q4 QuantizedWeight (a GGUF's output.weight),
    and a head tied to a vocabulary-parallel embedding."""
    head = QuantParallelLMHead(VOCAB, HIDDEN)
    head.load_weight(w["head"])
    from_q4 = QuantParallelLMHead(VOCAB, HIDDEN)
    from_q4.load_weight(quantize("q4", w["head"]))
    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
    emb.weight.weight_loader(emb.weight, w["emb"])
    tied = QuantParallelLMHead(VOCAB, HIDDEN)
    tied.load_tied(emb)
    out = {}
    for name, h in (("head", head), ("head_from_q4", from_q4), ("tied", tied)):
        logits = h(w["x"])
        out[name] = None if logits is None else logits.numpy()
    return out


def _refusals(path: str) -> list[str]:
    """ConfigError messages for splits off the 32-feature blocks: a layer, and a model whose MLP
    width (96) splits at 48."""
    messages = []
    for build in (lambda: QuantRowParallelLinear(160, 8, False, "int8"),  # 80 | 80
                  lambda: LlamaForCausalLM(ModelSpec.from_pretrained(Path(path)), "q4")):
        try:
            build()
        except ConfigError as e:
            messages.append(str(e))
        else:
            messages.append("accepted")
    return messages


@torch.inference_mode()
def quant_layers_rank(rank: int, bad_model_path: str) -> dict:
    w = quant_full_weights()
    out = {(m, s): _sharded_layers(m, w, s) for m in ("int8", "q4") for s in ("float", "quantized")}
    return {"layers": out, "heads": _heads(w), "refusals": _refusals(bad_model_path)}


def _weight_only_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear's product without the kernels' activation quantization: x dequant(W)^T (+ b)."""
    w = self.__dict__.get("_dequantized")
    if w is None:
        w = self.__dict__["_dequantized"] = self.quantized_weight().dequantize()  # [out, in] fp32, cached
    return linear(x, w, self._parameters["bias"])  # the fp32 GEMV/GEMM the float layers use


# The KV cache of these comparisons: float32 (a quantized model's own default on CPU is bf16, whose
# rounding would turn the gang's fp32 summation-order differences in k / v into one-bf16-ulp ones).
QUANT_TP_KV = "float32"


@contextmanager
def weight_only_math(model) -> Iterator[None]:
    """Every quantized layer (row-parallel ones keep their all-reduce, the head its gather) computes
    with its de-quantized weights and unquantized activations while inside, and ``model``'s decode
    steps take the module path, not the fused decoder stack (workers/models/decode_stack.py, which
    calls the kernels itself; it runs at one tp rank only)."""
    kernel_forward, fused = QuantLinear.forward, model.fused_decode
    QuantLinear.forward = _weight_only_forward
    model.fused_decode = False
    model._stack = None  # decided again under the setting
    try:
        yield
    finally:
        QuantLinear.forward = kernel_forward
        model.fused_decode = fused
        model._stack = None


def layer_probe(model) -> dict:
    """Layer 0's o_proj and down_proj buffers (row-parallel) and the LM head's scales."""
    layer = model.model.layers[0]
    return {"o": _buffers(layer.self_attn.o_proj), "down": _buffers(layer.mlp.down_proj),
            "head_scales": model.lm_head.scales.numpy().copy()}


def run_model(target, prompts: list[list[int]], max_tokens: int, rank: int | None = None, path: str | None = None,
              quantization: str = "none") -> dict:
    """Prefill logits (all positions) with the kernels; prefill logits and greedy tokens with
    weight-only math. target: a single-rank LLM (rank None), or this gang rank's ModelRunner (the
    gang's engine is built over it on rank 0: logits and tokens on rank 0 only)."""
    runner = target.engine.runner if rank is None else target
    model = runner.model
    out = {"probe": layer_probe(model), "kernels": {"logits": _numpy(prefill_logits(runner, prompts))}}  # collective
    with weight_only_math(model):
        logits = _numpy(prefill_logits(runner, prompts))
        if rank is None:
            tokens = generate(target.engine, prompts, max_tokens)
        else:
            tokens = run_gang(runner, rank, prompts, max_tokens, path, quantization=quantization,
                              kv_cache_dtype=QUANT_TP_KV)
    out["weight_only"] = {"logits": logits, "tokens": tokens}
    return out


def _numpy(t: torch.Tensor | None):
    return None if t is None else t.numpy()


def quant_model_rank(rank: int, runs: list[tuple[str, str]], prompts: list[list[int]], max_tokens: int) -> dict:
    """``run_model`` for each (checkpoint path, quantization) of ``runs`` on this gang rank."""
    out = {}
    for path, quantization in runs:
        runner = make_runner(path, quantization=quantization, kv_cache_dtype=QUANT_TP_KV)
        out[(path, quantization)] = run_model(runner, prompts, max_tokens, rank, path, quantization)
        del runner
    return out


def quant_tp_rank(rank: int, bad_model_path: str, runs: list[tuple[str, str]], prompts: list[list[int]],
                  max_tokens: int) -> dict:
    """Both cases in one gang (one start-up of the ranks): the layers, then the models."""
    return {"layers": quant_layers_rank(rank, bad_model_path),
            "models": quant_model_rank(rank, runs, prompts, max_tokens)}
