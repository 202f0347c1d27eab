"""Quantized weights under tensor parallelism (workers/layers/quant_parallel.py): one real 2-rank
gang (local processes) against the single-rank quantized layers and models.

The claim: a TP=2 gang computes what one rank computes with the same quantization. So
  - each rank's quantized buffers are exactly the single rank's (rows of the column-parallel
    layers, columns of the row-parallel ones with int8's full-row scales, vocabulary rows of the LM
    head), whether loaded from float tensors or from QuantizedWeights (a GGUF's 4-bit tensors,
    sliced without a trip through fp32);
  - layer outputs with the real kernels agree to fp32 rounding (the all-reduce sums partial
    products in another order; each rank's activation blocks are the single rank's);
  - whole models: SmolLM2 (uneven GQA split: 6 + 3 query heads, 2 + 1 kv heads; int8 quantized at
    load, q4 straight from its GGUF) and a random Qwen2 with q/k/v biases and an untied head. With
    weight-only math (the de-quantized weights, activations not quantized) logits agree to fp32
    rounding and greedy tokens are identical. With the kernels, which quantize activations (a step
    function), the ulp-sized summation-order difference flips a few activation codes and 30
    layers amplify it, so logits are compared by their median difference and argmax agreement;
  - splits off the 32-feature quantization blocks are refused with a ConfigError naming the sizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.quant_tp_cases import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    QUANT_TP_KV,
    VOCAB,
    WIDTH,
    quant_full_weights,
    quant_tp_rank,
    run_model,
)
from testkit.tp_cases import TINY_QWEN2, make_llm, save_tiny_qwen2
from workers.layers.quant_linear import QuantizedWeight, QuantLinear, QuantMergedLinear, quantize
from workers.models.checkpoint import gguf_source
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang
from workers.parallel.sharding import Shard, attention_shard, even_shard, vocab_shard

from testkit.tolerance import SHARDED_LAYER_FP32, SHARDED_FP32, Tolerance

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 150)), [7, 8], [1, 9906, 28, 601, 314, 2714]]
MAX_TOKENS = 24
TP2 = ParallelConfig(tp_size=2)


def _close(got: np.ndarray, want: np.ndarray, tol: Tolerance = SHARDED_FP32) -> None:
    """Default: 1e-4 of the largest value, as for a whole model (block-scaled partial products summed
    across ranks in another order); one rank's rows of one layer: SHARDED_LAYER_FP32."""
    tol.assert_close(got, want)


def _reference_layers(method: str, w: dict) -> dict:
    """The single-rank quantized layers on the full weights."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = QuantMergedLinear(HIDDEN, {"q": q, "k": kv, "v": kv}, True, method)
    for s in ("q", "k", "v"):
        qkv.load_weight(w[s], s)
        qkv.weight_loader(qkv.bias, w[s + "_b"], s)
    gate_up = QuantMergedLinear(HIDDEN, {"gate": WIDTH, "up": WIDTH}, False, method)
    for s in ("gate", "up"):
        gate_up.load_weight(w[s], s)
    o, down = QuantLinear(q, HIDDEN, False, method), QuantLinear(WIDTH, HIDDEN, True, method)
    o.load_weight(w["o"])
    down.load_weight(w["down"])
    down.weight_loader(down.bias, w["down_b"])
    return {"qkv": qkv, "gate_up": gate_up, "o": o, "down": down}


def _rank_rows(rank: int) -> dict[str, np.ndarray | Shard]:
    """Which rows of the single-rank fused layers rank ``rank`` holds, in its local order."""
    heads = attention_shard(HEADS, KV_HEADS, 2, rank)
    q, kv = heads.q_heads.scaled(HEAD_DIM), heads.kv_heads.scaled(HEAD_DIM)
    nq, nkv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    r = lambda s, off=0: np.arange(off + s.start, off + s.end)  # noqa: E731
    i = even_shard(WIDTH, 2, rank)
    return {"qkv": np.concatenate([r(q), r(kv, nq), r(kv, nq + nkv)]), "gate_up": np.concatenate([r(i), r(i, WIDTH)]),
            "o": q, "down": i}


@pytest.fixture(scope="module")
def gang(tmp_path_factory, smollm2_path) -> dict:
    """One TP=2 gang runs every case; then the single-rank engines run the same models.
    Returns {"layers": per-rank layer results, "models": {run name: {"tp2", "tp1", "spec"}}}."""
    from transformers import AutoConfig

    tmp = tmp_path_factory.mktemp("quant_tp")
    bad = tmp / "qwen2-mlp96"  # MLP width 96: splits at 48 over 2 ranks
    AutoConfig.for_model("qwen2", **TINY_QWEN2).save_pretrained(bad)
    qwen2 = save_tiny_qwen2(tmp / "qwen2", smollm2_path, intermediate_size=128)  # o_proj splits at 32
    runs = {f"{name}-{q}": (str(path), q) for name, path in (("smollm2", smollm2_path), ("qwen2", qwen2))
            for q in ("int8", "q4")}
    ranks = spawn_gang(quant_tp_rank, TP2, args=(str(bad), list(runs.values()), PROMPTS, MAX_TOKENS))
    models = {}
    for name, run in runs.items():
        llm = make_llm(run[0], quantization=run[1], kv_cache_dtype=QUANT_TP_KV)
        models[name] = {"tp2": [r["models"][run] for r in ranks], "tp1": run_model(llm, PROMPTS, MAX_TOKENS),
                        "spec": llm.engine.runner.model.spec, "path": run[0]}
        del llm
    return {"layers": [r["layers"] for r in ranks], "models": models}


@pytest.fixture(scope="module")
def layer_results(gang) -> list[dict]:
    return gang["layers"]


@pytest.fixture(scope="module")
def model_runs(gang) -> dict:
    return gang["models"]


@pytest.mark.parametrize("method", ["int8", "q4"])
@pytest.mark.parametrize("source", ["float", "quantized"])
@torch.inference_mode()
def test_quantized_parallel_layers_match_single_rank(layer_results, method, source):
    w = quant_full_weights()
    ref = _reference_layers(method, w)
    y = {"qkv": ref["qkv"](w["x"]).numpy(), "gate_up": ref["gate_up"](w["x"]).numpy(),
         "o": ref["o"](w["o_in"]).numpy(), "down": ref["down"](w["down_in"]).numpy()}
    for rank, res in enumerate(layer_results):
        out, rows = res["layers"][(method, source)], _rank_rows(rank)
        for name in ("qkv", "gate_up"):  # column-parallel: this rank's rows, bit for bit, and its outputs
            for buf, t in out["buffers"][name].items():  # codes, scales (, mins, bias)
                assert np.array_equal(t, getattr(ref[name], buf)[rows[name]].numpy()), (rank, name, buf)
            _close(out[name], y[name][:, rows[name]], SHARDED_LAYER_FP32)
        for name in ("o", "down"):  # row-parallel: this rank's columns of the single rank's codes
            shard: Shard = rows[name]
            want = ref[name].quantized_weight().cols(shard.start, shard.size).tensors
            for buf, t in out["buffers"][name].items():
                if buf != "bias":
                    assert np.array_equal(t, want[buf].numpy()), (rank, name, buf)
            _close(out[name], y[name])  # all-reduced: the full product on every rank
        assert np.array_equal(out["buffers"]["down"]["bias"], w["down_b"].numpy() if rank == 0 else np.zeros(HIDDEN))


def test_int8_row_shards_keep_the_full_rows_scales(layer_results):
    w = quant_full_weights()
    full = quantize("int8", w["down"]).tensors["scales"].numpy()
    for rank, res in enumerate(layer_results):
        shard = even_shard(WIDTH, 2, rank)
        scales = res["layers"][("int8", "float")]["buffers"]["down"]["scales"]
        assert np.array_equal(scales, full)
        alone = quantize("int8", w["down"][:, shard.start : shard.end]).tensors["scales"].numpy()
        assert not np.array_equal(scales, alone)  # what quantizing the shard on its own would give


@torch.inference_mode()
def test_quantized_lm_head_splits_the_vocabulary(layer_results):
    w = quant_full_weights()
    r0, r1 = layer_results
    for name, source in (("head", w["head"]), ("head_from_q4", quantize("q4", w["head"])), ("tied", w["emb"])):
        ref = QuantLinear(HIDDEN, VOCAB, False, "int8")
        ref.load_weight(source)
        _close(r0["heads"][name], ref(w["x"]).numpy(), SHARDED_LAYER_FP32)
        assert r1["heads"][name] is None  # logits gathered to tp rank 0 only


def test_splits_off_the_quantization_blocks_are_refused(layer_results):
    for rank, res in enumerate(layer_results):
        layer_msg, model_msg = res["refusals"]
        assert "tp_size=2" in layer_msg and "[8 x 160]" in layer_msg and ("[0, 80)", "[80, 160)")[rank] in layer_msg
        assert "quantization='q4'" in model_msg and f"[{TINY_QWEN2['hidden_size']} x 96]" in model_msg
        assert ("[0, 48)", "[48, 96)")[rank] in model_msg and "multiples of 32" in model_msg


RUNS = ["smollm2-int8", "smollm2-q4", "qwen2-int8", "qwen2-q4"]


@pytest.mark.parametrize("name", RUNS)
def test_quantized_tp2_loads_exactly_the_single_ranks_shards(model_runs, name):
    """Layer 0's row-parallel shards are columns of the single rank's codes (int8: with the full
    rows' scales; SmolLM2 q4: the GGUF's own 4-bit tensors), the head's rows its vocabulary rows."""
    run = model_runs[name]
    spec, single, method = run["spec"], run["tp1"]["probe"], name.split("-")[1]
    if name == "smollm2-q4":  # the loader reads q4 from the GGUF source, each rank slicing its 4-bit shards
        assert gguf_source(Path(run["path"])) is not None
    widths = {"o": spec.num_heads * spec.head_dim, "down": spec.intermediate_size}
    for rank, res in enumerate(run["tp2"]):
        probe = res["probe"]
        shards = {"o": attention_shard(spec.num_heads, spec.num_kv_heads, 2, rank).q_heads.scaled(spec.head_dim),
                  "down": even_shard(spec.intermediate_size, 2, rank)}
        for layer, shard in shards.items():
            full = {k: torch.from_numpy(v) for k, v in single[layer].items() if k != "bias"}
            want = QuantizedWeight(method, (spec.hidden_size, widths[layer]), full).cols(shard.start, shard.size)
            for buf, t in want.tensors.items():
                assert np.array_equal(probe[layer][buf], t.numpy()), (name, rank, layer, buf)
        vocab = vocab_shard(spec.vocab_size, 2, rank)
        head = probe["head_scales"]
        assert np.array_equal(head[: vocab.size], single["head_scales"][vocab.start : vocab.end])
        assert not head[vocab.size :].any()  # padding rows


@pytest.mark.parametrize("name", RUNS)
def test_quantized_tp2_matches_tp1_with_weight_only_math(model_runs, name):
    """Without the kernels' activation quantization the gang's arithmetic differs from one rank's by
    float summation order only: logits to fp32 rounding, identical greedy tokens."""
    run = model_runs[name]
    tp2, tp1 = run["tp2"][0]["weight_only"], run["tp1"]["weight_only"]
    _close(tp2["logits"], tp1["logits"])
    assert tp2["tokens"] == tp1["tokens"]
    assert run["tp2"][1]["weight_only"]["logits"] is None  # gathered to tp rank 0 only


@pytest.mark.parametrize("name", RUNS)
def test_quantized_tp2_is_close_to_tp1_with_the_kernels(model_runs, name):
    """The kernels quantize each token's activations per block of 32, a step function: the ulp-sized
    difference of the all-reduce's summation order moves a few codes by one step, and 30 layers
    amplify that (measured on SmolLM2, 64 prefill positions: median |logit difference| 0.3% of the
    largest logit, the argmax equal at 95% (int8) / 97% (q4) of positions; some greedy
    continuations then part after a near-tie)."""
    run = model_runs[name]
    tp2, tp1 = run["tp2"][0]["kernels"]["logits"], run["tp1"]["kernels"]["logits"]
    diff = np.abs(tp2 - tp1)
    assert np.median(diff) < 0.02 * np.abs(tp1).max(), np.median(diff)
    agree = (tp2.argmax(1) == tp1.argmax(1)).mean()
    assert agree >= 0.85, f"argmax equal at {agree:.1%} of positions"
