"""Error bounds of the quantized linear kernels (kernels/int8_linear.py, kernels/quant_linear.py)
against their float64 references, from the kernels' float sequence (tests/testkit/tolerance.py's
standard model: each float32 operation rounds with relative error at most u).

Both kernels quantize x exactly as the reference does and compute every block dot dot_b (32
products of integers) exactly; only the float steps differ from float64:
    int8  acc = fma(dot_b, sx_b, acc) over the B blocks, then y = fma(acc, sw, bias): B + 1 roundings
          of partial sums of the terms |dot_b sx_b sw| and |bias|;
    q4    acc = fma(dot_b * sx_b, d_b, acc); acc = fma(m_b, xs_b, acc) per block, xs_b = sx_b * sum(xq_b)
          rounded once, then acc + bias: at most 3B + 2 roundings of sums of |dot_b sx_b d_b|,
          |m_b xs_b| and |bias|.
So |kernel - reference| <= gamma_n * (sum of those absolute terms), n the rounding count.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.quant_formats import BLOCK, from_fp16_bits, unpack_q4
from kernels.quant_linear import quantize_activations_ref
from testkit.tolerance import gamma


def _block_terms(x: torch.Tensor, codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """|dot_b| * sx_b [T, N, B], sx [T, B] and |sum(xq_b)| sx_b [T, B] in float64."""
    T, (N, Kp) = x.shape[0], codes.shape
    xq, sx = quantize_activations_ref(x, Kp)
    xb = xq.double().view(T, -1, BLOCK)
    dots = torch.einsum("tbk,nbk->tnb", xb, codes.double().view(N, -1, BLOCK)).abs()  # [T, N, B]
    sxd = sx.double()
    return (dots * sxd[:, None, :]).numpy(), sxd.numpy(), (xb.sum(-1).abs() * sxd).numpy()


def int8_linear_error_bound(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None) -> np.ndarray:
    """[T, N] bound on |int8_linear - int8_linear_ref|."""
    terms, _, _ = _block_terms(x, qweight)
    s = terms.sum(-1) * np.abs(scales.double().numpy())[None, :]
    if bias is not None:
        s = s + np.abs(bias.double().numpy())[None, :]
    return gamma(terms.shape[-1] + 2) * s


def q4_linear_error_bound(x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                          bias: torch.Tensor | None = None) -> np.ndarray:
    """[T, N] bound on |q4_linear - q4_linear_ref|."""
    terms, _, xs = _block_terms(x, unpack_q4(qweight))
    dd, mm = from_fp16_bits(d).double().abs().numpy(), from_fp16_bits(m).double().abs().numpy()  # [N, B]
    s = (terms * dd[None]).sum(-1) + xs @ mm.T
    if bias is not None:
        s = s + np.abs(bias.double().numpy())[None, :]
    return gamma(3 * terms.shape[-1] + 3) * s
