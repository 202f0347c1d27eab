"""Float tolerances derived from the math rather than picked: forward-error bounds of float32
linear algebra that hold for any summation order, so for any BLAS blocking, FMA use or vector
width (AVX2, AVX-512, AMX) a CPU may choose.

Standard model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.2 and §3.1):
every float32 operation rounds with relative error at most u = 2^-24, and a dot product of n terms
computed in any order satisfies

    |fl(sum_k x_k w_k) - sum_k x_k w_k|  <=  gamma_n * sum_k |x_k w_k|,   gamma_n = n u / (1 - n u)

(a bias added to the sum counts as one more term). Two float32 computations of the same exact
value that each meet the bound differ by at most the sum of their bounds. Bounds are computed in
float64 from absolute values, so they are themselves exact to far below the tolerance they set.

Worked example: x = [1, -1], w = [1, 1] gives an exact 0 and a bound gamma_2 * 2 = 2.4e-7, where a
relative tolerance on the result alone (rtol * |0|) would allow no error at all.
"""

from __future__ import annotations

import numpy as np
import torch

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)


def gamma(n: int, u: float = U32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n accumulated roundings."""
    assert n * u < 1, n
    return n * u / (1 - n * u)


def _f64(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)).astype(np.float64)


def linear_error_bound(x: torch.Tensor | np.ndarray, w: torch.Tensor | np.ndarray,
                       b: torch.Tensor | np.ndarray | None = None,
                       x_err: np.ndarray | float = 0.0) -> np.ndarray:
    """Elementwise bound on |fl(x @ w.T + b) - (x_exact @ w.T + b)| for float32 x [T, K], w [N, K],
    b [N], where the x used may differ from x_exact by at most x_err (elementwise, broadcast):
    (|x| + x_err) |w|^T gamma_n + gamma_n |b| + x_err |w|^T, with n = K (+1 with a bias). Returns [T, N]."""
    xa, wa = np.abs(_f64(x)), np.abs(_f64(w))
    n = wa.shape[1] + (b is not None)
    err = np.broadcast_to(np.asarray(x_err, dtype=np.float64), xa.shape)
    s = (xa + err) @ wa.T + (0.0 if b is None else np.abs(_f64(b)))
    return gamma(n) * s + err @ wa.T


def product_error_bound(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray,
                        a_err: np.ndarray | float, b_err: np.ndarray | float) -> np.ndarray:
    """Elementwise bound on |fl(a * b) - a_exact * b_exact| where |a - a_exact| <= a_err and
    |b - b_exact| <= b_err: |a| b_err + a_err (|b| + b_err) for the inputs, plus u |a b| for the rounding."""
    aa, ba = np.abs(_f64(a)), np.abs(_f64(b))
    return aa * b_err + a_err * (ba + b_err) + U32 * aa * ba


def assert_within(got: torch.Tensor | np.ndarray, want: torch.Tensor | np.ndarray, bound: np.ndarray,
                  what: str = "value") -> None:
    """Assert |got - want| <= bound elementwise, naming the worst element when it fails."""
    g, w = _f64(got), _f64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    excess = np.abs(g - w) - bound
    if (excess > 0).any():
        i = np.unravel_index(int(np.argmax(excess)), excess.shape)
        raise AssertionError(f"{what}: at {i} got {g[i]!r}, want {w[i]!r}: off by {abs(g[i] - w[i]):.3g}, "
                             f"bound {bound[i]:.3g} ({int((excess > 0).sum())} of {excess.size} elements outside)")
