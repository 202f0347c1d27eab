"""Read a llama-architecture GGUF's tensors as checkpoint weights, keeping 4-bit tensors 4-bit.

GGUF Q4_0 / Q4_1 tensors become ``QuantizedWeight``s in our q4 layout by repacking their integer
codes (no trip through fp32): a Q4_1 block is 20 bytes, fp16 d, fp16 m, then 16 bytes whose byte j
holds element j (low nibble) and element j + 16 (high nibble), w = d * q + m; Q4_0 is 18 bytes
(d, 16 bytes) with w = d * (q - 8), i.e. m = -8 d (exact in fp16). Every other tensor type (F32,
F16, Q8_0, K-quants...) is dequantized with the ``gguf`` package and handed over as fp32, to be
quantized by the layer if it is a quantized one (SmolLM2's Q8_0 embedding: fp32 for the lookup,
int8 for the tied LM head).

llama.cpp's converter permutes the rows of attn_q / attn_k (it interleaves each head's two rotary
halves); ``_unpermute`` restores Hugging Face's order, on quantized rows as on float ones (a row
permutation never splits a block).

Names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` etc. (_NAMES).
Axes: N rows (output features), K input features, B blocks of 32 per row.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kernels.quant_formats import BLOCK, fp16_bits, pack_q4, padded_k
from workers.errors import CheckpointError
from workers.layers.quant_linear import QuantizedWeight
from workers.models.config import ModelSpec

logger = logging.getLogger(__name__)

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} has no llama-architecture counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def q4_from_gguf_blocks(raw: torch.Tensor, K: int, kind: str) -> QuantizedWeight:
    """raw uint8 [N, B * 20] (Q4_1) or [N, B * 18] (Q4_0) -> QuantizedWeight q4 [N, K]."""
    N = raw.shape[0]
    nb = -(-K // BLOCK)
    per_block = 20 if kind == "Q4_1" else 18
    blocks = raw.reshape(N, nb, per_block)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(N, nb)  # [N, B]
    if kind == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).view(N, nb)
        qs = blocks[..., 4:]
    else:
        m = d * -8
        qs = blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(N, nb * BLOCK)  # [N, B * 32] codes 0..15
    Kp = padded_k(K)
    q = torch.nn.functional.pad(q, (0, Kp - nb * BLOCK))
    pad_blocks = Kp // BLOCK - nb
    d = torch.nn.functional.pad(d.float(), (0, pad_blocks))
    m = torch.nn.functional.pad(m.float(), (0, pad_blocks))
    tensors = {"qweight": pack_q4(q), "scales": fp16_bits(d), "mins": fp16_bits(m)}
    return QuantizedWeight("q4", (N, K), tensors)


def _unpermute(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleave: rows (head, d/2, 2) -> (head, 2, d/2)."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _unpermute_q(w: torch.Tensor | QuantizedWeight, n_heads: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(w.method, w.shape, {k: _unpermute(v, n_heads).contiguous() for k, v in w.tensors.items()})
    return _unpermute(w, n_heads)


def iter_gguf(path: Path, spec: ModelSpec, keep_q4: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor) for every tensor of the GGUF: Q4_0/Q4_1 as q4 QuantizedWeights when
    ``keep_q4``, everything else fp32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises several types for bad files
        raise CheckpointError(f"{path}: unreadable GGUF file ({e})") from e
    counts: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        if keep_q4 and kind in ("Q4_0", "Q4_1") and len(shape) == 2:
            w: torch.Tensor | QuantizedWeight = q4_from_gguf_blocks(torch.from_numpy(np.array(t.data)), shape[1], kind)
        else:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        counts[kind] = counts.get(kind, 0) + 1
        if name.endswith("q_proj.weight"):
            w = _unpermute_q(w, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_q(w, spec.num_kv_heads)
        yield name, w
    logger.info("read %s: tensor types %s (q4 kept packed: %s)", path.name, counts, keep_q4)
