"""A tiny random Qwen2 GGUF written with the ``gguf`` package: byte-level BPE tokenizer with a few
merges, Qwen's special tokens and a ChatML template, q/k/v biases, an untied output matrix (as in
Qwen's Q4_K_M releases), rope base 1e6. By default all tensors are F32, so the GGUF's model is
exactly the de-quantized one. Used to test the GGUF -> checkpoint -> engine path without the real 1.6 GB.

``linear_type`` stores the linear weights (projections and the output matrix) in a quantized type:
Q4_0 / Q4_1 / Q5_0 / Q8_0 quantized by the ``gguf`` package, the K-quants (which gguf==0.19.0
cannot quantize) and any other block type as random valid blocks (random codes and sub-block
scales, small fp16 super-block scales), whose meaning is what ``gguf.quants.dequantize`` says.
K-quants need rows of whole 256-weight super-blocks: pass ``hidden=256`` (and ``ffn`` a multiple of 256).

Axes: V vocab, E hidden, I MLP width, H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

E, I, L, H, G, D = 64, 96, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# K-quant layouts: (bytes per 256-weight super-block, offsets of its fp16 scales, their magnitude)
_RANDOM_BLOCKS = {"Q4_K": (144, (0, 2), 2e-4), "Q5_K": (176, (0, 2), 1e-4), "Q6_K": (210, (208,), 5e-5),
                  "IQ4_NL": (18, (0,), 2e-2)}


def quantized_rows(rng: np.random.Generator, w: np.ndarray, kind: str) -> np.ndarray:
    """Float [N, K] -> the GGUF bytes uint8 [N, row bytes] of a ``kind`` tensor (see the module docstring)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind]
    if kind not in _RANDOM_BLOCKS:
        return quantize(w, qtype)
    size, scale_offsets, scale = _RANDOM_BLOCKS[kind]
    per = 32 if kind == "IQ4_NL" else 256
    n, k = w.shape
    assert k % per == 0, f"{kind} rows are whole {per}-weight blocks"
    blocks = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off in scale_offsets:
        d = (rng.uniform(0.5, 1.5, size=(n, k // per)) * scale).astype(np.float16)
        blocks[..., off:off + 2] = d.view(np.uint8).reshape(n, k // per, 2)
    return blocks.reshape(n, -1)


def write_tiny_qwen2_gguf(path: Path, seed: int = 0, *, linear_type: str = "F32", hidden: int = E,
                          ffn: int = I) -> dict[str, int]:
    """Write the GGUF; returns the special tokens' ids."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = [*bytes_to_unicode().values(), "de", "ef", "Ġd", *SPECIALS]  # 256 byte symbols first
    V = len(tokens)
    ids = {t: tokens.index(t) for t in SPECIALS}
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(128)
    e, i_, d = hidden, ffn, hidden // H
    w.add_embedding_length(e)
    w.add_block_count(L)
    w.add_feed_forward_length(i_)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (V - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control tokens
    w.add_token_merges(["d e", "e f", "Ġ d"])
    w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_chat_template(CHATML)

    def rand(*shape: int, scale: float = 0.2, offset: float = 0.0) -> np.ndarray:
        return (offset + rng.standard_normal(shape) * scale).astype(np.float32)

    def linear(name: str, rows: int, cols: int) -> None:
        x = rand(rows, cols)
        if linear_type == "F32":
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantized_rows(rng, x, linear_type), raw_dtype=GGMLQuantizationType[linear_type])

    # GGUF tensors are given in numpy (row-major) shape [out, in], like torch's Linear weight.
    w.add_tensor("token_embd.weight", rand(V, e))
    w.add_tensor("output_norm.weight", rand(e, scale=0.1, offset=1.0))
    linear("output.weight", V, e)
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rand(e, scale=0.1, offset=1.0))
        w.add_tensor(p + "ffn_norm.weight", rand(e, scale=0.1, offset=1.0))
        for name, rows in (("attn_q", H * d), ("attn_k", G * d), ("attn_v", G * d)):
            linear(p + name + ".weight", rows, e)
            w.add_tensor(p + name + ".bias", rand(rows, scale=0.5))
        linear(p + "attn_output.weight", e, H * d)
        linear(p + "ffn_gate.weight", i_, e)
        linear(p + "ffn_up.weight", i_, e)
        linear(p + "ffn_down.weight", e, i_)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ids
