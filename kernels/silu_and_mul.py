"""SwiGLU gate on the fused [gate | up] projection: out = silu(x[:, :I]) * x[:, I:].

silu(g) = g * sigmoid(g) = g / (1 + exp(-g)). Worked example (I = 1): x = [[0, 5]] -> silu(0) * 5 = 0;
x = [[2, 1]] -> 2 / (1 + e^-2) = 1.7616.

Dispatch: fp32 or bf16 CPU tensors -> the C++ kernel (one pass, vector exp accurate to a few ulp; torch needs
a chunk, a silu and a mul, each a dispatch and a temporary); anything else -> `silu_and_mul_ref`,
counted as a fallback. CUDA tensors -> the Triton kernel (kernels/triton_ops/silu_and_mul.py) if
triton is installed, else the reference (counted as a fallback). bf16: bf16(bf16(silu(gate)) * up),
like the reference's bf16 ops.

Axes: T tokens (any leading dims are accepted), I intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _build, _triton

_F32 = torch.float32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel takes


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    if x.is_cpu and x.dtype in _KERNEL_DTYPES:
        ext = _build.ext()
        if ext is not None:
            return ext.silu_and_mul(x)
        _build.note_ref_path("silu_and_mul")
    elif x.is_cuda and _triton.triton_available():
        return _triton.ops("silu_and_mul").silu_and_mul_triton(x)
    else:
        _build.note_fallback("silu_and_mul", _build.no_kernel_reason(x))
    return silu_and_mul_ref(x)
