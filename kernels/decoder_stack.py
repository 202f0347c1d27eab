"""Fused decoder stack: all Llama-family layers of a decode step in one C++ call.

A decode step of a small model is ~120 short kernel calls; from Python each pays a module call, a
wrapper, a pybind crossing and allocations, which add up to a large share of a 4-bit step
(benchmarks/README.md: "Fused decode stack" and "Figures moved out of the code"). ``DecoderStack`` (C++: kernels/csrc/decoder_stack.cpp) runs the very
same kernels with the same arguments in the same order from one loop, so its result is
bit-identical to the layer-by-layer path; ``decoder_stack_ref`` is that path written with the
kernels' Python wrappers (and, with the kernels disabled, with their torch references).

Per layer: x, r = rms_norm(h, r); qkv = linear(x); RoPE on q, k and k, v into the layer's paged
cache; a = paged decode attention; x, r = rms_norm(o_proj(a), r); h = down(silu(gate) * up)(x).
Finally rms_norm(h, r). Layer 0 has no residual yet: x = rms_norm(h), r = h.

Scope: decode-only steps (one new token per sequence) on CPU, one tensor-parallel rank, dense MLPs;
activations in fp32 with fp32, int8 or q4 linears (kernels/int8_linear.py, kernels/quant_linear.py),
or in bf16 with bf16 linears (a bf16 model). Anything else runs the module path
(workers/models/llama.py decides).

Example::

    layers = [StackLayerWeights(in_norm, post_norm, StackLinearWeights("q4", (qw, d, m), None, 576), ...)]
    stack = build_decoder_stack(layers, final_norm, eps=1e-5, num_heads=9, num_kv_heads=3, head_dim=64)
    hidden = stack.forward(h, cos, sin, kv_caches, slot_mapping, block_tables, context_lens, 16)  # [T, E]

Axes: T tokens (= sequences), E hidden, H query heads, G kv heads, D head dim, I MLP width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels import _build
from kernels.linear import gemv_max_tokens, linear
from kernels.paged_decode_attention import paged_decode_attention
from kernels.int8_linear import int8_linear
from kernels.quant_linear import q4_linear
from kernels.rms_norm import rms_norm
from kernels.rotary_and_cache_write import rotary_and_cache_write
from kernels.silu_and_mul import silu_and_mul

_KINDS = {"fp32": 0, "int8": 1, "q4": 2, "bf16": 3}


@dataclass(frozen=True)
class StackLinearWeights:
    """One projection: kind 'fp32' or 'bf16' (tensors = (w [N, K],)), 'int8' ((codes [N, Kp],
    scales [N])) or 'q4' ((codes [N, Kp / 2], scales, mins [N, Kp / 32])); bias [N] or None; K
    input features; tiles (int8, q4): kernels ``int8_tiles`` / ``q4_tiles`` of the same weights, or None."""

    kind: str
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    in_features: int
    tiles: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N], the wrappers' path
        if self.kind in ("fp32", "bf16"):
            return linear(x, self.tensors[0], self.bias)
        if self.kind == "int8":
            codes, scales = self.tensors
            return int8_linear(x, codes, scales, self.bias, self.tiles)
        codes, scales, mins = self.tensors
        return q4_linear(x, codes, scales, mins, self.bias, self.tiles)


@dataclass(frozen=True)
class StackLayerWeights:
    in_norm: torch.Tensor  # [E]
    post_norm: torch.Tensor  # [E]
    qkv: StackLinearWeights  # [(H + 2G) D, E]
    o: StackLinearWeights  # [E, H D]
    gate_up: StackLinearWeights  # [2I, E]
    down: StackLinearWeights  # [E, I]


def build_decoder_stack(layers: list[StackLayerWeights], final_norm: torch.Tensor, eps: float, num_heads: int,
                        num_kv_heads: int, head_dim: int) -> Any | None:
    """The C++ DecoderStack over these weights (referenced, not copied), or None when the CPU
    kernels are not available (the caller then keeps the module path)."""
    ext = _build.ext()
    if ext is None:
        return None

    def lin(w: StackLinearWeights) -> Any:
        t = (*w.tensors, None, None)[:3]
        return ext.StackLinear(_KINDS[w.kind], t[0], t[1], t[2], w.bias, w.in_features, w.tiles)

    cpp_layers = [ext.StackLayer(l.in_norm, l.post_norm, lin(l.qkv), lin(l.o), lin(l.gate_up), lin(l.down))
                  for l in layers]
    return ext.DecoderStack(cpp_layers, final_norm, eps, num_heads, num_kv_heads, head_dim, head_dim**-0.5,
                            gemv_max_tokens(final_norm.dtype))


def decoder_stack_ref(
    layers: list[StackLayerWeights],
    final_norm: torch.Tensor,  # [E]
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    h: torch.Tensor,  # [T, E]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
    kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k_cache, v_cache [S, G, D]
    slot_mapping: torch.Tensor,  # [T]
    block_tables: torch.Tensor,  # [T, max_blocks]
    context_lens: torch.Tensor,  # [T]
    block_size: int,
) -> torch.Tensor:  # [T, E]
    """The layer-by-layer path through the kernels' wrappers (same math and order as the stack)."""
    T, H, G, D = h.shape[0], num_heads, num_kv_heads, head_dim
    r = None
    for layer, (k_cache, v_cache) in zip(layers, kv):
        x, r = rms_norm(h, layer.in_norm, eps, r)
        r = h if r is None else r
        q, k, v = layer.qkv(x).view(T, H + 2 * G, D).split([H, G, G], dim=1)  # [T, H|G|G, D]
        rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        a = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, D**-0.5)
        assert isinstance(a, torch.Tensor)  # no lse asked for
        x, r = rms_norm(layer.o(a.view(T, H * D)), layer.post_norm, eps, r)
        h = layer.down(silu_and_mul(layer.gate_up(x)))
    return rms_norm(h, final_norm, eps, r)[0]


__all__ = ["StackLayerWeights", "StackLinearWeights", "build_decoder_stack", "decoder_stack_ref"]
