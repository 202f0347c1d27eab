"""y = x W^T (+ b) with a hand-written GEMV for decode-sized batches on CPU, fp32 or bf16.

At small T the product is bound by reading W from memory (each weight is used only T times). The
C++ kernel streams W exactly once per pass with both cores (rows split OpenMP-static, blocks of 2-8
rows with AVX-512 FMA accumulators for up to 8 rows of x at once) and skips MKL's per-call setup.

Thresholds (rows of x sent to the GEMV; more go to ``F.linear``, i.e. MKL's fp32 GEMM or
oneDNN's bf16 one, which uses AMX-BF16 or AVX512-BF16 where the CPU has them):
  GEMV_MAX_TOKENS = 16 for fp32, chosen from a sweep of GEMV vs MKL over SmolLM2-135M's 121
  matrices (benchmarks/README.md, "Figures moved out of the code"): the GEMV wins while the product
  is bound by reading W; past a few dozen rows MKL's cache-blocked GEMM wins.
  BF16_GEMV_MAX_TOKENS = 8 for bf16: one pass of the GEMV over W serves up to 8 rows of x; past
  that it reads W twice while oneDNN's bf16 GEMM (AMX / AVX512-BF16) is already compute-efficient.
  benchmarks/batched_linear_bench.py times both per batch size (benchmarks/README.md, "bf16 and
  int8 activations"): the GEMV won at 1-8 rows, oneDNN at 32-64.
bf16 GEMV: x, w and bias bf16, fp32 accumulation (vdpbf16ps on AVX512-BF16 CPUs, widen + FMA on
other AVX-512 CPUs, scalar code elsewhere), y rounded to bf16 once.

Worked example: x = [[1, 2]], W = [[1, 0], [0, 1], [1, 1]], b = [0, 0, 1] -> y = [[1, 2, 4]].

Dispatch (decided inside the extension, which saves Python attribute lookups): fp32 or bf16 CPU x
(w and bias of x's dtype) with at most the dtype's threshold of rows (leading dims flattened) and
W with contiguous rows -> C++ GEMV; more rows, or a transposed W -> at::linear (by design, not a
fallback). Other CPU dtypes or mixed dtypes -> `linear_ref` (= F.linear), counted as a fallback.
CUDA uses F.linear (cuBLAS) by design, not counted: no Triton GEMV is planned to beat it.

Axes: T tokens, K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _build

# Largest token counts sent to the GEMV kernel (see above); 8 rows of x share each pass over W.
GEMV_MAX_TOKENS = 16
BF16_GEMV_MAX_TOKENS = 8

_F32 = torch.float32
_BF16 = torch.bfloat16


def gemv_max_tokens(dtype: torch.dtype) -> int:
    """The GEMV threshold of activations in ``dtype`` (fp32 or bf16)."""
    return BF16_GEMV_MAX_TOKENS if dtype is _BF16 else GEMV_MAX_TOKENS


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, K], w [N, K], bias [N] -> [T, N]
    return F.linear(x, w, bias)


def prepack(w: torch.Tensor, rows_hint: int = 64) -> torch.Tensor | None:
    """oneDNN's own blocked copy of a bf16 CPU weight w [N, K], for ``linear(..., packed=)``; None
    where there is nothing to gain or this torch has no oneDNN linear. ``F.linear`` on a plain bf16
    weight has oneDNN reorder W into the blocked (AMX / AVX512-BF16) layout on every call, a full
    read and write of W per step; the packed copy does it once. rows_hint: the batch oneDNN tunes
    the blocking for (the results do not depend on it)."""
    if not (w.is_cpu and w.dtype is _BF16 and w.dim() == 2 and torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows_hint)
    except (AttributeError, RuntimeError) as e:  # a torch built without the op: the plain path stays
        _build.note_fallback("linear", f"no oneDNN weight prepacking in this torch ({e})")
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ the weight ``packed`` (``prepack``'s copy of a [out_features, K] weight)^T
    (+ bias) through oneDNN's bf16 GEMM -> [..., out_features] bf16."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, K] (or [..., K]), w [N, K], bias [N] -> [T, N] (or [..., N])
    # packed: ``prepack(w)``; rows past the GEMV's range then go through oneDNN on it (the same GEMM
    # as F.linear on w, without the per-call reorder of W)
    if packed is not None and x.dtype is _BF16 and x.numel() > BF16_GEMV_MAX_TOKENS * x.shape[-1]:
        return packed_linear(x, packed, w.shape[0], bias)
    if x.is_cpu:
        dt = x.dtype
        if (dt is _F32 or dt is _BF16) and w.dtype is dt and (bias is None or bias.dtype is dt):
            ext = _build.ext()
            if ext is not None:
                return ext.linear(x, w, bias, BF16_GEMV_MAX_TOKENS if dt is _BF16 else GEMV_MAX_TOKENS)
            _build.note_ref_path("linear")
        else:
            _build.note_fallback("linear", f"no kernel for x {x.dtype} with w {w.dtype}")
    return F.linear(x, w, bias)
