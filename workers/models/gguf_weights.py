"""Read a llama- or qwen2-architecture GGUF's tensors as checkpoint weights, keeping quantized
tensors quantized where the engine's format has a native path.

Which GGUF types load from their codes into which engine format (Q4_0 / Q4_1 / Q4_K -> q4, Q8_0 ->
int8), and the error each other type adds, is in workers/models/gguf_quants.py. Every other tensor
is de-quantized with the ``gguf`` package and handed over as fp32, to be quantized by the layer if
it is a quantized one (SmolLM2's Q8_0 embedding: fp32 for the lookup, int8 for the tied LM head).
A tensor type outside ``SUPPORTED_TYPES`` or an unreadable (truncated) file is one CheckpointError
naming the file and what to do.

llama.cpp's converter permutes the rows of attn_q / attn_k of llama-architecture models (it
interleaves each head's two rotary halves); ``_unpermute`` restores Hugging Face's order, on
quantized rows as on float ones (a row permutation never splits a block).

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

from workers.errors import CheckpointError
from workers.layers.quant_linear import QuantizedWeight
from workers.models.config import ModelSpec
from workers.models.gguf_quants import NATIVE, SUPPORTED_TYPES, dequantize_raw, native_weight

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


def _unpermute(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleave: rows (head, d/2, 2) -> (head, 2, d/2)."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _unpermute_q(w: torch.Tensor | QuantizedWeight, n_heads: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(w.method, w.shape, {k: _unpermute(v, n_heads).contiguous() for k, v in w.tensors.items()})
    return _unpermute(w, n_heads)


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else ""


def _reader_class():
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map: the reader slices its data
    once per metadata value (a tokenizer's vocabulary is ~150k strings), and each slice of an
    ``np.memmap`` goes through memmap's Python-level ``__getitem__``/``__array_finalize__``; slices
    of an ndarray view of the same mapping are the same bytes without that cost (the test
    test_gguf_file.py::test_fast_reader_reads_what_the_plain_reader_reads compares the two)."""
    from gguf import GGUFReader

    class _ArrayReader(GGUFReader):
        @property  # type: ignore[override]  # a property over GGUFReader's plain attribute
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._mapped = value.view(np.ndarray)  # keeps the memmap (its base) alive

    return _ArrayReader


def open_gguf(path: Path):
    """A GGUFReader over ``path``; CheckpointError naming the file for a truncated / unreadable one
    or one holding a tensor type Duet does not read."""
    try:
        reader = _reader_class()(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises several types for bad files
        raise CheckpointError(f"GGUF file {str(path)!r} cannot be read ({e}); it may be truncated: "
                              "re-download it, or pass a checkpoint directory") from None
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if bad:
        raise CheckpointError(f"GGUF file {str(path)!r}: tensor type(s) {', '.join(bad)} not supported (supported: "
                              f"{', '.join(SUPPORTED_TYPES)}); use a file quantized to one of these (e.g. Q4_K_M, "
                              "Q8_0) or a safetensors checkpoint")
    return reader


def has_native_tensors(path: Path, quantization: str) -> bool:
    """True if some linear weight of the GGUF loads natively into ``quantization``'s format."""
    reader = open_gguf(path)
    return any((t.tensor_type.name, quantization) in NATIVE and t.name != "token_embd.weight" for t in reader.tensors)


def iter_gguf(path: Path, spec: ModelSpec, quantization: str) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor) for every tensor of the GGUF: linear weights whose type has a native path
    to ``quantization``'s format (workers/models/gguf_quants.py) as QuantizedWeights, everything
    else (and the token embedding, a lookup table) fp32."""
    reader = open_gguf(path)
    permuted = _architecture(reader) == "llama"  # llama.cpp permutes q/k rows of llama-arch models only
    counts: dict[str, int] = {}
    native = 0
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        w: torch.Tensor | QuantizedWeight | None = None
        if len(shape) == 2 and name != "model.embed_tokens.weight":
            w = native_weight(torch.from_numpy(np.array(t.data)), shape[1], kind, quantization)
            native += w is not None
        if w is None:
            w = dequantize_raw(t.data, kind, shape)
        counts[kind] = counts.get(kind, 0) + 1
        if permuted and name.endswith("q_proj.weight"):
            w = _unpermute_q(w, spec.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = _unpermute_q(w, spec.num_kv_heads)
        yield name, w
    logger.info("read %s: tensor types %s (%d loaded natively as %s)", path.name, counts, native, quantization)
