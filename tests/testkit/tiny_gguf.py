"""A tiny random Qwen2 GGUF written with the ``gguf`` package: byte-level BPE tokenizer with a few
merges, Qwen's special tokens and a ChatML template, q/k/v biases, an untied output matrix (as in
Qwen's Q4_K_M releases), rope base 1e6. All tensors are F32, so the GGUF's model is exactly the
de-quantized one. Used to test the GGUF -> checkpoint -> engine path without the real 1.6 GB.

Axes: V vocab, E hidden, I MLP width, H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

E, I, L, H, G, D = 64, 96, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_qwen2_gguf(path: Path, seed: int = 0) -> dict[str, int]:
    """Write the GGUF; returns the special tokens' ids."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = [*bytes_to_unicode().values(), "de", "ef", "Ġd", *SPECIALS]  # 256 byte symbols first
    V = len(tokens)
    ids = {t: tokens.index(t) for t in SPECIALS}
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(128)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
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

    # GGUF tensors are given in numpy (row-major) shape [out, in], like torch's Linear weight.
    w.add_tensor("token_embd.weight", rand(V, E))
    w.add_tensor("output_norm.weight", rand(E, scale=0.1, offset=1.0))
    w.add_tensor("output.weight", rand(V, E))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rand(E, scale=0.1, offset=1.0))
        w.add_tensor(p + "ffn_norm.weight", rand(E, scale=0.1, offset=1.0))
        for name, rows in (("attn_q", H * D), ("attn_k", G * D), ("attn_v", G * D)):
            w.add_tensor(p + name + ".weight", rand(rows, E))
            w.add_tensor(p + name + ".bias", rand(rows, scale=0.5))
        w.add_tensor(p + "attn_output.weight", rand(E, H * D))
        w.add_tensor(p + "ffn_gate.weight", rand(I, E))
        w.add_tensor(p + "ffn_up.weight", rand(I, E))
        w.add_tensor(p + "ffn_down.weight", rand(E, I))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ids
