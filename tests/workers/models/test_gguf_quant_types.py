"""GGUF quant types into Duet's formats (workers/models/gguf_quants.py): a tiny Qwen2 GGUF whose
linear weights are stored in each type (written with the ``gguf`` package; K-quants as random valid
blocks, which gguf==0.19.0 cannot quantize) loads into the engine's format and matches the float
reference - the ``gguf`` package's de-quantization of the same tensor - within the type's stated
error. The engine loads the native types from their codes when served from the .gguf path alone.
A tensor type Duet does not read is refused in one line naming the file and what to do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.testkit.tiny_gguf import write_tiny_qwen2_gguf
from workers.errors import CheckpointError
from workers.layers.quant_linear import QuantizedWeight, QuantLinear, quantize
from workers.models.config import ModelSpec
from workers.models.gguf_quants import NATIVE
from workers.models.gguf_weights import iter_gguf, open_gguf

# type -> (engine quantization it is tested with, loaded from its codes?)
TYPES = {"Q4_0": ("q4", True), "Q4_1": ("q4", True), "Q4_K": ("q4", True), "Q8_0": ("int8", True),
         "Q5_K": ("q4", False), "Q6_K": ("q4", False), "Q5_0": ("int8", False)}


def write(path: Path, kind: str) -> Path:
    big = kind.endswith("_K")  # K-quant rows are whole 256-weight super-blocks
    write_tiny_qwen2_gguf(path, linear_type=kind, hidden=256 if big else 64, ffn=512 if big else 96)
    return path


def reference(path: Path) -> dict[str, torch.Tensor]:
    """HF name -> the gguf package's fp32 de-quantization (q/k rows need no un-permuting: qwen2)."""
    from gguf.quants import dequantize

    from workers.models.gguf_weights import hf_name

    out = {}
    for t in open_gguf(path).tensors:
        shape = [int(s) for s in reversed(t.shape.tolist())]
        out[hf_name(t.name)] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
    return out


def bound(kind: str, ref: torch.Tensor) -> torch.Tensor:
    """The stated per-weight error bound of ``kind`` loaded into its engine format (gguf_quants.py)."""
    N, K = ref.shape
    blocks = ref.view(N, K // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)  # [N, B, 1]
    if kind in ("Q4_0", "Q4_1"):
        b = torch.full_like(blocks, 1e-6) * amax  # exact up to fp32 rounding of d * q + m
    elif kind == "Q4_K":
        b = 2.0**-9 * amax.expand_as(blocks)  # fp16 rounding of d * sc and dmin * m
    elif TYPES[kind][0] == "int8":
        b = (ref.abs().amax(1) / 127 / 2)[:, None, None].expand_as(blocks)  # half the row's step
    else:  # converted to q4: half a q4 step of the block, plus fp16 rounding of its d and m
        span = blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)
        b = (span / 30 + 2.0**-9 * amax).expand_as(blocks)
    return b.reshape(N, K) * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("kind", list(TYPES))
def test_each_type_loads_within_its_stated_error(tmp_path, kind):
    path = write(tmp_path / f"tiny.{kind}.gguf", kind)
    quantization, native = TYPES[kind]
    assert ((kind, quantization) in NATIVE) == native
    spec_like = ModelSpec(model_type="qwen2", vocab_size=1, hidden_size=1, intermediate_size=1, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=1, rms_norm_eps=1e-6, rope_theta=1e6,
                          rope_scaling=None, max_position_embeddings=1, tie_word_embeddings=False,
                          attention_bias=True, mlp_bias=False, eos_token_ids=())
    ref = reference(path)
    linears = 0
    for name, w in iter_gguf(path, spec_like, quantization):
        if name.endswith(".bias") or "norm" in name or name == "model.embed_tokens.weight":
            assert isinstance(w, torch.Tensor) and torch.equal(w, ref[name]), name
            continue
        linears += 1
        assert isinstance(w, QuantizedWeight) == native, name
        layer = QuantLinear(w.shape[1], w.shape[0], method=quantization)
        layer.load_weight(w)  # what the engine's layer holds
        got = layer.quantized_weight().dequantize()
        err = (got - ref[name]).abs()
        assert (err <= bound(kind, ref[name])).all(), (name, float(err.max()))
        if native:  # loading the codes gives what quantizing the float reference gives, or better
            requant = quantize(quantization, ref[name]).dequantize()
            assert err.pow(2).mean() <= (requant - ref[name]).pow(2).mean() * (1 + 1e-3), name
    assert linears == 1 + 2 * 7  # output + 7 per layer


@pytest.mark.parametrize("kind", ["Q4_K"])  # (Q8_0's codes give what quantizing its floats gives: not observable)
def test_served_from_the_gguf_file_alone_loads_codes(tmp_path, kind):
    """A .gguf file as the model (resolve_model's path: config and tokenizer from the GGUF
    metadata, prepared into a cache) with the type's engine quantization: the weights come from the
    file's codes (each layer equals the native conversion), and it generates."""
    from workers.llm import LLM
    from workers.models.assets.prepare import prepare_gguf_file
    from workers.models.checkpoint import gguf_source
    from workers.models.gguf_quants import native_weight
    from workers.sampling_params import SamplingParams

    path = write(tmp_path / f"tiny.{kind}.gguf", kind)
    prepared = prepare_gguf_file(path, tmp_path / "cache")  # what resolve_model does for a .gguf name
    assert gguf_source(prepared) == path.resolve()
    quantization = TYPES[kind][0]
    llm = LLM(str(prepared), quantization=quantization, kv_cache_memory_bytes=4 << 20)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    raw = next(t for t in open_gguf(path).tensors if t.name == "blk.0.ffn_down.weight")
    shape = [int(s) for s in reversed(raw.shape.tolist())]
    want = native_weight(torch.from_numpy(np.array(raw.data)), shape[1], kind, quantization)
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    for name, t in want.tensors.items():
        assert torch.equal(getattr(layer, name), t), name


def test_unsupported_type_is_one_line_naming_the_file(tmp_path):
    from workers.models.assets.prepare import prepare_gguf_file

    path = tmp_path / "odd.gguf"
    write_tiny_qwen2_gguf(path, linear_type="IQ4_NL")
    with pytest.raises(CheckpointError) as e:
        prepare_gguf_file(path, tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and "odd.gguf" in msg and "IQ4_NL" in msg and "Q4_K" in msg
