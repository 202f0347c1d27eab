"""RoPE on q and k in place, then k and v written into the paged KV cache, in one call.

Rotate-half layout (HF Llama/Qwen2 checkpoints): for a head vector x = [x1 | x2] (halves of D/2)
and the token's cos/sin rows (D/2 each, already looked up for its position):
    x <- [x1 * cos - x2 * sin | x2 * cos + x1 * sin]
then  k_cache[slot_mapping[t]] = k[t]  and  v_cache[slot_mapping[t]] = v[t]  for every token t whose
slot is >= 0 (a negative slot marks a padding token: rotated, not written).

Worked example (D = 2, cos = 0, sin = 1, i.e. a quarter turn): x = [1, 2] -> [1*0 - 2*1, 2*0 + 1*1]
= [-2, 1].

Dispatch: fp32 or bf16 CPU tensors -> the C++ kernel (separate multiplies like the reference, so the results
are bit-identical, in bf16 too: each product and sum rounded to bf16 as torch rounds them); anything else -> `rotary_and_cache_write_ref`, counted as a fallback. CUDA
tensors -> the Triton kernel (kernels/triton_ops/rotary_and_cache_write.py) if triton is installed.

Axes: T tokens, H query heads, G kv heads, D head dim, S cache slots.
"""

from __future__ import annotations

import torch

from kernels import _build, _triton

_F32 = torch.float32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel takes


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [T, N, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_and_cache_write_ref(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, G, D], rotated in place
    v: torch.Tensor,  # [T, G, D]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = do not write
) -> None:
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
    q.copy_(_rotate(q, c, s))
    k.copy_(_rotate(k, c, s))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.index_copy_(0, slots, k[keep].to(k_cache.dtype))  # a bf16 cache under fp32 activations: rounded
    v_cache.index_copy_(0, slots, v[keep].to(v_cache.dtype))


def rotary_and_cache_write(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, G, D], rotated in place
    v: torch.Tensor,  # [T, G, D]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = do not write
) -> None:
    if q.is_cpu and q.dtype in _KERNEL_DTYPES:
        ext = _build.ext()
        if ext is not None:
            ext.rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
            return
        _build.note_ref_path("rotary_and_cache_write")
    elif q.is_cuda and _triton.triton_available():
        _triton.ops("rotary_and_cache_write").rotary_and_cache_write_triton(
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping
        )
        return
    else:
        _build.note_fallback("rotary_and_cache_write", _build.no_kernel_reason(q))
    rotary_and_cache_write_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
