"""Decode steps of a Llama-family model through the fused C++ decoder stack (kernels/decoder_stack.py).

``fused_stack(model, layer_types)`` decides once per model whether its layers can run fused and, if so, builds
the stack over the model's own weight tensors (referenced, not copied, so in-place reloads are
seen). Eligible: CPU, one tensor-parallel rank, every layer a dense ``LlamaMLP``, and the C++
kernels loaded; fp32 activations with fp32, int8 or q4 projections, or a bf16 model (bf16
activations and projections). ``LlamaForCausalLM.forward`` then
uses it for decode-only steps (one new token per sequence, no ring chunk): plain decoding,
continuous batching of decodes and speculative verification rows (which run as decode rows). The
result is bit-identical to the module path (tests/workers/models/test_decode_stack.py); prefill and mixed
steps keep the module path, where the kernel time dwarfs the Python overhead.

``EngineConfig.fused_decode`` (``pools[].engine.fused_decode``; ``DUET_FUSED_DECODE=0`` at the CLI
edge) turns it off for A/B measurements and debugging: it reaches the model as its ``fused_decode``
attribute (workers/models/loader.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kernels.decoder_stack import StackLayerWeights, StackLinearWeights, build_decoder_stack
from workers.layers.activation import SiluAndMul
from workers.layers.linear import Linear
from workers.layers.quant_linear import QuantLinear
from workers.parallel.groups import get_group

logger = logging.getLogger(__name__)


_FLOAT_KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _linear(m: nn.Module, dtype: torch.dtype) -> StackLinearWeights | None:
    """The stack's view of one projection of a model whose activations are ``dtype``, or None."""
    if isinstance(m, QuantLinear):
        if dtype is not torch.float32:
            return None  # quantized kernels take fp32 activations
        tensors = (m.qweight, m.scales) if m.method == "int8" else (m.qweight, m.scales, m.mins)
        return StackLinearWeights(m.method, tensors, m.bias, m.in_features, m.tiles)
    if isinstance(m, Linear) and m.weight.dtype is dtype and dtype in _FLOAT_KINDS:
        return StackLinearWeights(_FLOAT_KINDS[dtype], (m.weight,), m.bias, m.weight.shape[1])
    return None


def fused_stack(model: Any, layer_types: tuple[type[Any], type[Any], type[Any]]) -> Any | None:
    """The C++ decoder stack for ``model`` (a LlamaForCausalLM), or None when it is not eligible.

    layer_types: the exact (decoder layer, MLP, attention) classes the stack reproduces, passed by
    the model family (workers/models/llama.py ``FUSED_STACK_TYPES``); a layer of any other class,
    a subclass included, keeps the module path."""
    decoder_layer_type, mlp_type, attention_type = layer_types
    if not model.fused_decode or get_group("tp").world_size != 1:
        return None
    inner = model.model
    emb = inner.embed_tokens.weight
    if emb.device.type != "cpu" or emb.dtype not in _FLOAT_KINDS:
        return None
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not decoder_layer_type or type(mlp) is not mlp_type or type(attn) is not attention_type:
            return None
        if hasattr(attn, "q_norm") or attn.attn.window is not None or attn.attn.softcap is not None \
                or attn.attn.scale != attn.d**-0.5 or not isinstance(mlp.act, SiluAndMul):
            return None  # variants the C++ stack does not build
        found = [_linear(m, emb.dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        lins = [x for x in found if x is not None]
        if len(lins) < len(found):
            return None
        layers.append(StackLayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *lins))
    a0 = inner.layers[0].self_attn
    stack = build_decoder_stack(layers, inner.norm.weight, inner.norm.eps, a0.h, a0.g, a0.d)
    if stack is not None:
        logger.debug("decode steps run through the fused decoder stack (%d layers)", len(layers))
    return stack


__all__ = ["fused_stack"]
