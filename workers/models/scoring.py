"""Score a token sequence with a loaded model (teacher forcing): per-token log-probabilities and
perplexity, the quality measure of quantized models.

perplexity = exp(-mean_i log p(ids[i + 1] | ids[: i + 1])) over the L - 1 predicted tokens; lower is
better, 1 is perfect. The whole sequence runs as one prefill through the model's own attention path,
in a private KV cache, so no engine state is touched.

Example::

    model, spec = load_model(path, torch.float32, quantization="q4")
    ppl = perplexity(model, spec, tokenizer.encode(text))

Axes: L sequence length, V vocab, G kv heads, D head dim.
"""

from __future__ import annotations

import math

import torch

from workers.layers.attention_metadata import AttentionMetadata, PrefillSpan
from workers.models.config import ModelSpec
from workers.models.llama import LlamaForCausalLM


@torch.inference_mode()
def next_token_logits(model: LlamaForCausalLM, spec: ModelSpec, ids: list[int], block_size: int = 16,
                      kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits of the next token after each prefix ids[: i + 1], i < L - 1: [L - 1, V] fp32.
    kv_dtype: the KV cache's element type (None = the model's dtype; EngineConfig.kv_dtype is what an
    engine runs, e.g. bfloat16 for an int8 / q4 model on CPU)."""
    L = len(ids)
    assert L >= 2, "need at least two tokens to score"
    blocks = -(-L // block_size)
    dtype = kv_dtype or next(model.parameters()).dtype
    kv = torch.zeros(spec.num_layers, 2, blocks * block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype)
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.arange(L),
        num_decodes=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillSpan(0, L, None, None)],
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32)[None, :],
        prefill_cu_seqlens=torch.tensor([0, L], dtype=torch.int32),
        prefill_context_lens=torch.tensor([L], dtype=torch.int32),
    )
    tokens = torch.tensor(ids)
    hidden = model(tokens, torch.arange(L), [(layer[0], layer[1]) for layer in kv], meta)  # [L, E]
    logits = model.compute_logits(hidden[:-1])  # [L - 1, V]
    assert logits is not None  # one process: it is tp rank 0
    return logits.float()


def token_logprobs(model: LlamaForCausalLM, spec: ModelSpec, ids: list[int],
                   kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for i < L - 1: [L - 1]."""
    logits = next_token_logits(model, spec, ids, kv_dtype=kv_dtype)  # [L - 1, V]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def perplexity(model: LlamaForCausalLM, spec: ModelSpec, ids: list[int], kv_dtype: torch.dtype | None = None) -> float:
    return math.exp(-token_logprobs(model, spec, ids, kv_dtype).mean().item())
