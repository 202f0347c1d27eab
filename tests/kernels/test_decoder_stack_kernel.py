"""The fused decoder stack (C++) vs the layer-by-layer path through the kernels' wrappers.

Both call the same kernels with the same arguments in the same order, so the hidden states and the
KV caches they leave must be bit-identical (torch.equal), for fp32, int8 and q4 projections and for
a bf16 stack (bf16 activations, caches and projections; past BF16_GEMV_MAX_TOKENS its projections
go to oneDNN's bf16 GEMM in both), with
and without q/k/v biases, GQA ratios 1 and 3, 1..20 sequences (past GEMV_MAX_TOKENS = 16 the fp32
projections go to at::linear in both), contexts that end mid-block, on every ISA path. With the
kernels disabled, decoder_stack_ref runs the torch references: the stack agrees with that within
float tolerance (fp32 weights; the quantized kernels' references are checked in their own tests).
"""

from __future__ import annotations

import pytest
import torch

from kernels import _build
from kernels.decoder_stack import StackLayerWeights, StackLinearWeights, build_decoder_stack, decoder_stack_ref
from kernels.quant_formats import quantize_int8, quantize_q4
from kernels.int8_linear import int8_tiles
from kernels.quant_linear import q4_tiles

from testkit.tolerance import MODEL_FP32

BLOCK = 4


def _lin(kind: str, N: int, K: int, bias: bool, g: torch.Generator) -> StackLinearWeights:
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g) * 0.1 if bias else None
    if kind == "bf16":
        return StackLinearWeights(kind, (w.bfloat16(),), None if b is None else b.bfloat16(), K)
    tensors = {"fp32": lambda: (w,), "int8": lambda: quantize_int8(w), "q4": lambda: quantize_q4(w)}[kind]()
    return StackLinearWeights(kind, tuple(tensors), b, K)


def _case(kind: str, T: int, H: int, G: int, bias: bool, seed: int, L: int = 3, E: int = 96, D: int = 16, I: int = 80):
    g = torch.Generator().manual_seed(seed)
    layers = [
        StackLayerWeights(1 + 0.1 * torch.randn(E, generator=g), 1 + 0.1 * torch.randn(E, generator=g),
                          _lin(kind, (H + 2 * G) * D, E, bias, g), _lin(kind, E, H * D, False, g),
                          _lin(kind, 2 * I, E, False, g), _lin(kind, E, I, False, g))
        for _ in range(L)
    ]
    final = 1 + 0.1 * torch.randn(E, generator=g)
    ctx = [1 + (7 * t + seed) % 23 for t in range(T)]  # context lengths incl. the new token; some mid-block
    nb = max((c + BLOCK - 1) // BLOCK for c in ctx)
    perm = torch.randperm(T * nb, generator=g)  # scattered blocks
    tables = perm.view(T, nb).to(torch.int32)
    S = T * nb * BLOCK
    kv = [(torch.randn(S, G, D, generator=g), torch.randn(S, G, D, generator=g)) for _ in range(L)]
    slots = torch.tensor([int(tables[t, (c - 1) // BLOCK]) * BLOCK + (c - 1) % BLOCK for t, c in enumerate(ctx)])
    pos = torch.tensor(ctx, dtype=torch.float32)[:, None] - 1
    freqs = pos * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))  # [T, D/2]
    inputs = dict(h=torch.randn(T, E, generator=g), cos=freqs.cos(), sin=freqs.sin(), slot_mapping=slots,
                  block_tables=tables, context_lens=torch.tensor(ctx, dtype=torch.int32), block_size=BLOCK)
    if kind == "bf16":  # activations, norms and caches in bf16 too
        bf = torch.bfloat16
        layers = [StackLayerWeights(l.in_norm.to(bf), l.post_norm.to(bf), l.qkv, l.o, l.gate_up, l.down) for l in layers]
        final, kv = final.to(bf), [(k.to(bf), v.to(bf)) for k, v in kv]
        inputs |= {n: inputs[n].to(bf) for n in ("h", "cos", "sin")}
    return layers, final, kv, inputs


def _run_both(kind: str, T: int, H: int, G: int, bias: bool, seed: int):
    layers, final, kv, x = _case(kind, T, H, G, bias, seed)
    kv_ref = [(k.clone(), v.clone()) for k, v in kv]
    stack = build_decoder_stack(layers, final, 1e-5, H, G, 16)
    got = stack.forward(x["h"], x["cos"], x["sin"], kv, x["slot_mapping"], x["block_tables"], x["context_lens"],
                        BLOCK)
    want = decoder_stack_ref(layers, final, 1e-5, H, G, 16, kv=kv_ref, **x)
    return got, want, kv, kv_ref


@pytest.mark.parametrize("kind", ["fp32", "int8", "q4", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("H,G,bias", [(4, 4, False), (6, 2, True)])
def test_stack_is_bit_identical_to_the_layer_path(ext, isa: str, kind: str, T: int, H: int, G: int, bias: bool) -> None:
    got, want, kv, kv_ref = _run_both(kind, T, H, G, bias, seed=T * 10 + H)
    assert got.shape == want.shape == (T, 96)
    assert torch.equal(got, want)
    for (k, v), (kr, vr) in zip(kv, kv_ref):  # the caches it wrote, too
        assert torch.equal(k, kr) and torch.equal(v, vr)


@pytest.mark.parametrize("kind", ["int8", "q4"])
@pytest.mark.parametrize("T", [1, 4, 17])
def test_tiles_change_no_bit_of_the_stack(ext, isa: str, kind: str, T: int) -> None:
    """Quantized projections that carry their weights in tile order (what a loaded int8 / q4 model
    gives them on a VNNI CPU) compute the same bits as without, and as the layer path without them."""
    layers, final, kv, x = _case(kind, T, 6, 2, True, seed=T)

    def tiled(w: StackLinearWeights) -> StackLinearWeights:
        tiles = int8_tiles(w.tensors[0]) if kind == "int8" else q4_tiles(*w.tensors)
        return StackLinearWeights(w.kind, w.tensors, w.bias, w.in_features, tiles)

    with_tiles = [StackLayerWeights(l.in_norm, l.post_norm, *(tiled(w) for w in (l.qkv, l.o, l.gate_up, l.down)))
                  for l in layers]
    outs = []
    for ls in (layers, with_tiles):
        caches = [(k.clone(), v.clone()) for k, v in kv]
        outs.append(build_decoder_stack(ls, final, 1e-5, 6, 2, 16).forward(
            x["h"], x["cos"], x["sin"], caches, x["slot_mapping"], x["block_tables"], x["context_lens"], BLOCK))
    want = decoder_stack_ref(layers, final, 1e-5, 6, 2, 16, kv=[(k.clone(), v.clone()) for k, v in kv], **x)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[1], want)


def test_stack_matches_the_torch_references(ext) -> None:
    layers, final, kv, x = _case("fp32", 5, 6, 2, True, seed=3)
    kv_ref = [(k.clone(), v.clone()) for k, v in kv]
    got = build_decoder_stack(layers, final, 1e-5, 6, 2, 16).forward(
        x["h"], x["cos"], x["sin"], kv, x["slot_mapping"], x["block_tables"], x["context_lens"], BLOCK)
    before = _build.set_cpu_kernels_enabled(False)
    try:
        want = decoder_stack_ref(layers, final, 1e-5, 6, 2, 16, kv=kv_ref, **x)
    finally:
        _build.set_cpu_kernels_enabled(before)
    MODEL_FP32.assert_close(got, want)


def test_bad_inputs_raise_clear_errors(ext) -> None:
    layers, final, kv, x = _case("q4", 2, 4, 4, False, seed=1)
    stack = build_decoder_stack(layers, final, 1e-5, 4, 4, 16)
    args = (x["h"], x["cos"], x["sin"])
    tail = (x["slot_mapping"], x["block_tables"], x["context_lens"], BLOCK)
    with pytest.raises(RuntimeError, match="kv caches for 3 layers"):
        stack.forward(*args, kv[:2], *tail)
    with pytest.raises(RuntimeError, match="h must be float32"):
        stack.forward(x["h"][:, :10], x["cos"], x["sin"], kv, *tail)
    bad_tables = torch.full_like(x["block_tables"], 10_000)
    with pytest.raises(RuntimeError, match="paged_decode_attention|rotary_and_cache_write"):
        stack.forward(*args, kv, x["slot_mapping"], bad_tables, x["context_lens"], BLOCK)
    with pytest.raises(RuntimeError, match="qkv must be"):
        build_decoder_stack(layers, final, 1e-5, 4, 2, 16)  # wrong kv head count for these weights
    bf16_norms = [StackLayerWeights(l.in_norm.bfloat16(), l.post_norm.bfloat16(), l.qkv, l.o, l.gate_up, l.down)
                  for l in layers]
    with pytest.raises(RuntimeError, match="bf16 stack takes bf16 linears only"):
        build_decoder_stack(bf16_norms, final.bfloat16(), 1e-5, 4, 4, 16)  # bf16 activations, q4 projections
