"""y = x W^T (+ b) with a hand-written GEMV for decode-sized batches on CPU.

At small T the product is bound by reading W from memory (each weight is used only T times). The
C++ kernel streams W exactly once per pass with both cores (rows split OpenMP-static, blocks of 2-8
rows with AVX-512 FMA accumulators for up to 8 rows of x at once) and skips MKL's per-call setup.

Threshold GEMV_MAX_TOKENS = 16, chosen from a sweep of GEMV vs F.linear (MKL) over SmolLM2-135M's
121 matrices (benchmarks/README.md, "Figures moved out of the code"): the GEMV wins while the
product is bound by reading W; past a few dozen rows it turns compute bound and MKL's cache-blocked
GEMM (which reuses each weight tile across many rows) wins, so T > 16 keeps a margin and goes to MKL.

Worked example: x = [[1, 2]], W = [[1, 0], [0, 1], [1, 1]], b = [0, 0, 1] -> y = [[1, 2, 4]].

Dispatch (fp32 CPU decided inside the extension, which saves Python attribute lookups): x with
at most GEMV_MAX_TOKENS rows (leading dims flattened) and W with contiguous rows -> C++ GEMV; more
rows, or a transposed W -> at::linear, i.e. MKL (by design, not a fallback). Other dtypes on CPU ->
`linear_ref` (= F.linear), counted as a fallback. CUDA uses F.linear (cuBLAS) by design, not
counted: no Triton GEMV is planned to beat it.

Axes: T tokens, K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _build

# Largest token count sent to the GEMV kernel (see the measurements above); 8 rows of x share each
# pass over W, so 9..16 rows cost two passes.
GEMV_MAX_TOKENS = 16

_F32 = torch.float32


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, K], w [N, K], bias [N] -> [T, N]
    return F.linear(x, w, bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, K] (or [..., K]), w [N, K], bias [N] -> [T, N] (or [..., N])
    if x.is_cpu and x.dtype is _F32:
        ext = _build.ext()
        if ext is not None:
            return ext.linear(x, w, bias, GEMV_MAX_TOKENS)  # decides GEMV vs at::linear by T
        _build.note_ref_path("linear")
    elif x.is_cpu:
        _build.note_fallback("linear", f"no kernel for {x.dtype}")
    return F.linear(x, w, bias)
