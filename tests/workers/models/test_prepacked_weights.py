"""EngineConfig.prepack_weights (workers/models/loader.py, kernels/linear.py ``prepack``): a bf16 model
on the CPU keeps oneDNN's blocked copy of every linear layer's and the LM head's weight, used for
batches past the bf16 GEMV's rows. It is an optimisation of the same GEMM: the model's outputs stay
those of the plain path up to the summation order of fp32 accumulations (oneDNN may block K
differently for the packed layout), and a weight reloaded in place drops its stale copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.linear import BF16_GEMV_MAX_TOKENS
from testkit.tolerance import estimate
from workers.layers.linear import Linear
from workers.layers.vocab_parallel import ParallelLMHead
from workers.models.loader import load_model
from workers.models.scoring import next_token_logits

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "public_domain_sample.txt"


def _packed(model: torch.nn.Module) -> list[bool]:
    return [m.packed is not None for m in model.modules() if isinstance(m, (Linear, ParallelLMHead))]


def test_bf16_model_prepacks_and_scores_like_the_plain_path(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    from kernels.linear import prepack

    if prepack(torch.zeros(2, 2, dtype=torch.bfloat16)) is None:
        pytest.skip("this torch / CPU has no oneDNN bf16 linear to pack for: the plain path is the only one")
    ids = AutoTokenizer.from_pretrained(smollm2_path).encode(SAMPLE.read_text())[:300]
    plain, spec = load_model(smollm2_path, torch.bfloat16, prepack_weights=False)
    packed, _ = load_model(smollm2_path, torch.bfloat16)
    assert not any(_packed(plain)) and not plain.prepacked
    assert all(_packed(packed)) and packed.prepacked and len(_packed(packed)) == 4 * spec.num_layers + 1
    fp32, _ = load_model(smollm2_path, torch.float32)
    assert not any(_packed(fp32)) and not fp32.prepacked  # fp32 keeps MKL's path: nothing to pack

    a, b = next_token_logits(plain, spec, ids), next_token_logits(packed, spec, ids)  # [L - 1, V], 299 rows
    assert a.shape[0] > BF16_GEMV_MAX_TOKENS  # the packed copies did the work
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    # a bf16 model re-rounds its activations after every op, so one fp32 sum in another order moves
    # later rounding decisions: greedy near-ties flip about as often as between bf16 and fp32 (97.1%
    # of positions equal, tests/workers/models/test_quant_model.py); measured here 96.7% on 2 threads
    # (oneDNN splits some GEMMs differently), 100% on 1
    assert agree == estimate(1.0, abs=0.05, why="bf16's own rounding noise: bf16 vs fp32 agree on 97.1% of greedy"
                                                " tokens; the packed and plain GEMMs differ only in summation order")
    rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
    assert rel == estimate(0.0, abs=0.05, why="bf16 activations re-rounded in 30 layers after fp32 sums in another"
                                              " order: a few percent of drift in the logits at most")

    layer = packed.model.layers[0].mlp.down_proj
    layer.weight_loader(layer.weight, layer.weight.data.clone())  # an in-place reload
    assert layer.packed is None  # its stale copy is gone; the plain weight serves it
    assert layer.prepack() and layer.packed is not None


def test_quantized_layer_bf16_copy_serves_large_batches_with_its_own_values() -> None:
    """quantized_batches: 'bf16' (workers/layers/quant_linear.py): a batch of more than
    BF16_COPY_MIN_ROWS rows runs on the layer's de-quantized weight rounded to bf16, through oneDNN;
    up to that many rows the quantized kernel runs exactly as without the copy."""
    from kernels.linear import prepack
    from testkit.tolerance import bf16_linear_error_bound
    from workers.layers.quant_linear import BF16_COPY_MIN_ROWS, QuantLinear

    g = torch.Generator().manual_seed(3)
    for method in ("q4", "int8"):
        layer = QuantLinear(576, 960, bias=True, method=method)
        layer.load_weight(torch.randn(960, 576, generator=g) * 576**-0.5)
        layer.weight_loader(layer.bias, torch.randn(960, generator=g))
        small, large = (torch.randn(n, 576, generator=g) for n in (BF16_COPY_MIN_ROWS, BF16_COPY_MIN_ROWS + 9))
        want_small, want_large = layer(small), layer(large)
        if not layer.make_bf16_copy():
            assert prepack(torch.zeros(2, 2, dtype=torch.bfloat16)) is None  # only where oneDNN cannot pack
            continue
        assert torch.equal(layer(small), want_small)  # the kernel's rows, untouched
        got = layer(large)
        assert got.dtype is torch.float32 and got.shape == want_large.shape
        xb, wb = large.bfloat16(), layer.quantized_weight().dequantize().bfloat16()
        exact = torch.nn.functional.linear(xb.double(), wb.double())
        bound = torch.as_tensor(bf16_linear_error_bound(xb, wb, None, exact))
        err = (got.double() - layer.bias.double() - exact).abs()
        assert bool((err <= bound + 1e-6 * layer.bias.double().abs()).all()), float((err - bound).max())
        layer.load_weight(torch.randn(960, 576, generator=g))
        assert layer.bf16_copy is None  # reloaded: the stale copy is gone


def test_q4_model_with_bf16_batches_scores_like_its_kernels(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    from workers.layers.quant_linear import QuantLinear

    ids = AutoTokenizer.from_pretrained(smollm2_path).encode(SAMPLE.read_text())[:300]
    kernel, spec = load_model(smollm2_path, torch.float32, quantization="q4", quantized_batches="kernel")
    copies, _ = load_model(smollm2_path, torch.float32, quantization="q4", quantized_batches="bf16")
    layers = [m for m in copies.modules() if isinstance(m, QuantLinear)]
    if not any(m.bf16_copy is not None for m in layers):
        assert not torch.backends.mkldnn.is_available()  # nothing to pack with
        return
    assert all(m.bf16_copy is not None for m in layers)
    assert not any(m.bf16_copy is not None for m in kernel.modules() if isinstance(m, QuantLinear))
    a, b = next_token_logits(kernel, spec, ids), next_token_logits(copies, spec, ids)  # one 300-row prefill
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree == estimate(1.0, abs=0.06, why="the same 4-bit weights with bf16 instead of int8 activations: they"
                                                " flip greedy near-ties about as often as q4 vs fp32 does (95.9%)")


def test_a_steps_decode_rows_stay_on_the_quantized_kernel() -> None:
    """StepRows: in a step of n decode rows then a long prompt chunk, the decode rows run on the
    quantized kernel (the same bits as a decode-only step: no load-dependent numbers) and only the
    prompt rows on the bf16 copy, also when the step has more decode rows than the copy's threshold;
    without step rows the whole batch goes to the copy as before."""
    from workers.layers.quant_linear import BF16_COPY_MIN_ROWS, QuantLinear, StepRows

    g = torch.Generator().manual_seed(4)
    for method in ("q4", "int8"):
        layer = QuantLinear(576, 960, bias=True, method=method)
        layer.load_weight(torch.randn(960, 576, generator=g) * 576**-0.5)
        layer.weight_loader(layer.bias, torch.randn(960, generator=g))
        rows = StepRows()
        if not layer.make_bf16_copy(rows):
            continue  # no oneDNN to pack with: the kernel runs every row anyway
        decode, prompt = torch.randn(5, 576, generator=g), torch.randn(BF16_COPY_MIN_ROWS + 7, 576, generator=g)
        alone = layer(decode)  # a decode-only step: the kernel
        prompt_on_copy = layer(prompt)  # rows.decode = 0: the copy
        rows.decode = 5
        got = layer(torch.cat([decode, prompt]))
        assert torch.equal(got[:5], alone) and torch.equal(got[5:], prompt_on_copy)
        rows.decode = 0
        assert not torch.equal(layer(torch.cat([decode, prompt]))[:5], alone)  # what the split prevents
        rows.decode = BF16_COPY_MIN_ROWS  # too few prompt rows left for the copy: all on the kernel
        mixed = torch.cat([decode, prompt])[: BF16_COPY_MIN_ROWS + 20]
        assert torch.equal(layer(mixed), layer._kernel(mixed, layer.bias))
        # a decode-only step of more rows than the copy's threshold: still the kernel, row by row
        # the same bits as when those rows share a step with a prompt chunk
        many = torch.randn(BF16_COPY_MIN_ROWS + 16, 576, generator=g)
        rows.decode = many.shape[0]
        decode_only = layer(many)
        assert torch.equal(decode_only, layer._kernel(many, layer.bias))
        rows.decode = many.shape[0]
        assert torch.equal(layer(torch.cat([many, prompt]))[: many.shape[0]], decode_only)
