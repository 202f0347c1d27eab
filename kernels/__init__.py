"""Duet's fused ops: one op per file, each with a torch reference `<op>_ref` and a dispatching
wrapper `<op>` that runs the C++ CPU kernel (kernels/csrc/) on fp32 CPU tensors, the Triton kernel
(kernels/triton_ops/, optional `triton` extra) on CUDA tensors, and the reference otherwise
(counted in `fallback_counts()`; see kernels/_triton.py).

    rms_norm(x, weight, eps, residual=None) -> (out, new_residual | None)
    silu_and_mul(x) -> out
    linear(x, w, bias=None, packed=None) -> y    (C++ GEMV for T <= 16 rows (bf16: 8), else MKL / oneDNN
                                                  via F.linear, or oneDNN on ``prepack(w)``'s blocked copy)
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out=None)
    rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)   (in place)
    varlen_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, block_size,
                           scale, tree_parents=None, out=None, return_lse=False)  (prefill / spec verify)
    merge_attn_states(outs, lses) -> (out, lse)      (merge partial attentions: split-KV, ring attention)
    grouped_gemm(x, w, offsets) -> y                 (MoE: per-expert x[rows of e] @ w[e]^T, rows sorted by expert)
    int8_linear(x, qweight, scales, bias=None, tiles=None)   (int8 weights, int8 activations; batch-invariant)
    q4_linear(x, qweight, d, m, bias=None, tiles=None)       (4-bit weights, int8 activations; formats in quant_formats.py)
    int8_tiles(qweight), q4_tiles(qweight, d, m) -> tiles    (the weights in the VNNI path's order, made once:
                                                              no per-call repack; the same results)

The C++ extension is built on first use (or by `python -m kernels.build`); see kernels/_build.py for
the cache, `set_cpu_kernels_enabled(False)`, and how a failed build falls back (with a warning and a count).
"""

from kernels._build import (
    cpu_kernels_available,
    cpu_kernels_enabled,
    fallback_counts,
    reset_fallback_counts,
    set_cpu_kernels_enabled,
)
from kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref
from kernels.linear import linear, linear_ref, prepack
from kernels.merge_attn_states import merge_attn_states, merge_attn_states_ref
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.int8_linear import int8_linear, int8_linear_ref, int8_tiles
from kernels.quant_linear import q4_linear, q4_linear_ref, q4_tiles
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary_and_cache_write import rotary_and_cache_write, rotary_and_cache_write_ref
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from kernels.varlen_paged_attention import varlen_paged_attention, varlen_paged_attention_ref

__all__ = [
    "cpu_kernels_available",
    "cpu_kernels_enabled",
    "fallback_counts",
    "grouped_gemm",
    "grouped_gemm_ref",
    "int8_linear",
    "int8_linear_ref",
    "int8_tiles",
    "q4_linear",
    "q4_linear_ref",
    "q4_tiles",
    "linear",
    "linear_ref",
    "prepack",
    "merge_attn_states",
    "merge_attn_states_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "reset_fallback_counts",
    "rms_norm",
    "rms_norm_ref",
    "rotary_and_cache_write",
    "rotary_and_cache_write_ref",
    "set_cpu_kernels_enabled",
    "silu_and_mul",
    "silu_and_mul_ref",
    "varlen_paged_attention",
    "varlen_paged_attention_ref",
]
