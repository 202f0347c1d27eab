"""RMSNorm with an optional fused residual add (vLLM's fused_add_rms_norm), as HF Llama computes it.

    r   = x + residual            (or r = x without a residual)
    out = r * rsqrt(mean(r^2, -1) + eps) * weight       (all in fp32)
    returns (out, r if a residual was given else None)

Worked example (E = 2, eps = 0, weight = [1, 2]): x = [[3, 4]], residual = [[0, 0]] -> r = [[3, 4]],
mean(r^2) = 12.5, rsqrt = 0.2828 -> out = [[0.8485, 2.2627]], new_residual = [[3, 4]].

Dispatch: fp32 or bf16 CPU tensors -> the C++ kernel (one call, no temporaries, where F.rms_norm launches
several ops and allocates their results); anything else -> `rms_norm_ref`, counted as a
fallback. CUDA tensors -> the Triton kernel (kernels/triton_ops/rms_norm.py) if triton is installed,
else the reference (counted as a fallback). bf16: the kernel rounds where the reference's bf16 ops
round (r, the normalised row, its product with the weight) and sums in fp32.

Axes: T tokens (any leading dims are accepted), E hidden size.
"""

from __future__ import annotations

import torch

from kernels import _build, _triton

_F32 = torch.float32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel takes


def rms_norm_ref(
    x: torch.Tensor,  # [T, E]
    weight: torch.Tensor,  # [E]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, E]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([T, E], [T, E] | None)
    r = x if residual is None else x + residual
    rf = r.float()
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), (None if residual is None else r)


def rms_norm(
    x: torch.Tensor,  # [T, E]
    weight: torch.Tensor,  # [E], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, E]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (out [T, E], new_residual [T, E] | None)
    if x.is_cpu and x.dtype in _KERNEL_DTYPES:  # cheaper than x.device.type, which builds a device object
        ext = _build.ext()
        if ext is not None:
            return ext.rms_norm(x, weight, eps, residual)
        _build.note_ref_path("rms_norm")
    elif x.is_cuda and _triton.triton_available():
        return _triton.ops("rms_norm").rms_norm_triton(x, weight, eps, residual)
    else:
        _build.note_fallback("rms_norm", _build.no_kernel_reason(x))
    return rms_norm_ref(x, weight, eps, residual)
