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

Where no bound is practical (a whole model's forward pass, an attention kernel's online softmax),
a comparison uses one of the named ``Tolerance`` kinds below, each saying why it has its size; a
quantity that is estimated rather than computed (a rate measured on a sampled trace, a fit) uses
``estimate(want, abs=..., rel=..., why=...)``. Every float comparison in tests/ goes through this
module: tests/test_tolerance_usage.py fails on a literal tolerance (``abs=1e-5``, ``rtol=...``,
``abs(a - b) < 1e-6``) or a bare ``allclose`` / ``assert_close`` anywhere else. Exact comparisons
(token ids, greedy outputs, kernels specified bit-identical) stay exact (``==``, ``torch.equal``).

Worked example::

    KERNEL_FP32.assert_close(kernels.linear(x, w), kernels.linear_ref(x, w))
    assert got_logprobs == LOGPROB_ACROSS_BATCHES.approx(want_logprobs)
    tol = KERNEL_FP32 if dtype is torch.float32 else bf16_ulps(3)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)


def gamma(n: int, u: float = U32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n accumulated roundings."""
    assert n * u < 1, n
    return n * u / (1 - n * u)


def _f64(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)


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
        i = tuple(int(k) for k in np.unravel_index(int(np.argmax(excess)), excess.shape))
        raise AssertionError(f"{what}: at {i} got {g[i]!r}, want {w[i]!r}: off by {abs(g[i] - w[i]):.3g}, "
                             f"bound {bound[i]:.3g} ({int((excess > 0).sum())} of {excess.size} elements outside)")


# ---- named tolerances -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """One kind of float comparison: ``|got - want| <= atol + rtol * |want| + rmax * max|want|``,
    elementwise (``rmax``: relative to the largest magnitude of ``want``, for values whose error
    scales with the whole tensor's size rather than each element's, like an all-reduced sum).
    Non-finite values must match exactly (``-inf`` where both are ``-inf``); NaN never matches.
    ``why`` says where the size comes from."""

    name: str
    why: str
    atol: float = 0.0
    rtol: float = 0.0
    rmax: float = 0.0

    def times(self, k: float) -> Tolerance:
        """This kind, k times as wide (``why`` of the call site says why k)."""
        return replace(self, name=f"{self.name} x{k:g}", atol=self.atol * k, rtol=self.rtol * k, rmax=self.rmax * k)

    def bound(self, want: torch.Tensor | np.ndarray | Any) -> np.ndarray:
        """The allowed |got - want| for each element of ``want`` (finite ones)."""
        w = np.abs(_f64(want))
        finite = w[np.isfinite(w)]
        top = float(finite.max()) if finite.size else 0.0
        return self.atol + self.rtol * w + self.rmax * top

    def check(self, got: Any, want: Any, what: str = "value") -> str | None:
        """None when ``got`` is within this tolerance of ``want``, else why not (the worst element)."""
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype != want.dtype:
            return f"{what}: dtype {got.dtype} != {want.dtype}"
        g, w = _f64(got), _f64(want)
        if g.shape != w.shape:
            return f"{what}: shape {g.shape} != {w.shape}"
        if np.isnan(g).any() or np.isnan(w).any():
            return f"{what}: NaN at {np.argwhere(np.isnan(g) | np.isnan(w))[:4].tolist()}"
        inf = ~np.isfinite(w) | ~np.isfinite(g)
        if (g[inf] != w[inf]).any():
            i = tuple(int(k) for k in np.argwhere(inf & (g != w))[0])
            return f"{what}: at {i} got {g[i]!r}, want {w[i]!r}"
        try:
            assert_within(np.where(inf, 0.0, g), np.where(inf, 0.0, w), self.bound(np.where(inf, 0.0, w)), what)
        except AssertionError as e:
            return f"{e} [tolerance {self.name}]"
        return None

    def assert_close(self, got: Any, want: Any, what: str = "value") -> None:
        """Assert ``got`` is within this tolerance of ``want`` (same shape, and same dtype for two tensors)."""
        if (failure := self.check(got, want, what)) is not None:
            raise AssertionError(failure)

    def allclose(self, got: Any, want: Any) -> bool:
        return self.check(got, want) is None

    def approx(self, want: Any) -> Any:
        """``pytest.approx(want)`` with this tolerance, for scalars and lists (pytest's rule:
        max(atol, rtol * |want|) per element). Not for ``rmax`` kinds."""
        import pytest

        assert self.rmax == 0, f"{self.name}: approx() has no max-relative form; use assert_close"
        return pytest.approx(want, abs=self.atol, rel=self.rtol)


EXACT = Tolerance("exact", "the two are specified bit-identical; the tolerance form only gives a better message")

# float32 unit roundoff u = 6e-8 throughout; "order 1" means |value| ~ 1, as the kernel tests' random inputs are.

KERNEL_FP32 = Tolerance(
    "kernel vs reference, fp32", atol=1e-5, rtol=1e-5,
    why="A CPU/Triton kernel vs its torch *_ref on float32 inputs of order 1: the same math summed in another order "
        "(vector lanes, blocking, a split-KV merge, an online softmax). Rounding errors of a reordered sum of n "
        "random-sign terms grow like sqrt(n) u: ~2.4e-6 relative at n = 1536 (the largest K or context in these "
        "tests), exp and rsqrt add 1-2 ulp. 1e-5 is ~4x that on any vector width, while a wrong row, slot, mask, "
        "scale or tail moves outputs by 1e-2 or more.")

ELEMENTWISE_FP32 = Tolerance(
    "elementwise fp32", atol=1e-6, rtol=1e-6,
    why="A few float32 operations per element on values of order 1 (a rotation a*c - b*s, a penalty, a division), "
        "evaluated by two code paths that may fuse or reorder them: each result within a few ulp (u = 6e-8) of the "
        "terms it came from; 1e-6 is ~16 ulp of order-1 values, and atol covers results that cancel to near 0.")

ELEMENTWISE_FP32_RELATIVE = Tolerance(
    "elementwise fp32, relative", atol=1e-30, rtol=1e-6,
    why="A few float32 operations per element with no cancellation (silu(g) * u: exp, divide, multiply): each "
        "output within ~8 ulp of the reference, relative to itself however small; atol only covers gates below "
        "-87, where a vector exp clamps to ~1e-37 instead of a denormal.")

BLOCK_QUANT_FP32 = Tolerance(
    "block-quantized kernel vs reference", atol=1e-4, rtol=1e-4,
    why="A block-quantized matmul (x quantized per block of 32, exact integer block dots) accumulated in float32 "
        "vs a float64 reference: K/32 scaled block sums added in another order, outputs of order 1..10 (~1e-6 "
        "relative); 1e-4 leaves a wide margin and still catches a wrong block, scale, nibble or tail (~1e-1).")

MODEL_FP32 = Tolerance(
    "forward pass, fp32", atol=1e-4, rtol=1e-4,
    why="Hidden states or logits after several layers (norms, attention, MLP or MoE, lm_head) computed by two "
        "float32 implementations (ours vs transformers', the fused stack vs layer by layer, a pruned lm_head vs "
        "the full one): each layer's reorder error (~1e-6 relative) passes through RMS norms and residual sums, "
        "so the logits (order 10) end up to ~1e-5 apart. 1e-4 keeps ~10x margin; a wrong weight, rope or mask "
        "moves logits by more than 1e-1.")

SHARDED_LAYER_FP32 = Tolerance(
    "one sharded layer vs unsharded, fp32", rmax=1e-5,
    why="One tensor-parallel matmul whose partial sums are all-reduced across ranks: the K terms are added in "
        "another order, an error that scales with the largest output (an output near 0 gets the same absolute "
        "error), so relative to max|want|: ~sqrt(K) u = 2e-6 at K = 1536; 1e-5 keeps 5x margin.")

SHARDED_FP32 = Tolerance(
    "sharded model vs single rank, fp32", rmax=1e-4,
    why="A whole model in a TP/EP/P-D gang vs one process: every sharded layer reorders its sums "
        "(SHARDED_LAYER_FP32) and the differences pass through every later layer, as in MODEL_FP32; relative to "
        "the largest logit or cached K/V value, since errors scale with the whole tensor, not each element.")

RING_ATTENTION_FP32 = SHARDED_FP32.times(2)  # also merges partial softmaxes by log-sum-exp instead of one pass

LOGPROB_ACROSS_BATCHES = Tolerance(
    "logprobs across batch shapes", atol=1e-4,
    why="A token's logprob computed with its sequence alone vs inside a batch (or on another worker after a "
        "hand-off, or along the speculative path): every matmul is blocked by its row count, so each of the "
        "model's 30 layers sums in another order, and the log-softmax of logits of order 10 (ulp ~1e-6) keeps "
        "what accumulates. Seen (benchmarks/README.md, 'Logprobs across batch shapes'): 1.0e-5 on an AVX-512 AMD "
        "EPYC, where an abs=1e-5 bound failed; here up to 8e-6 on the AVX-512 and AVX2 kernel paths, 1.2e-5 with "
        "the torch references, 2.2e-5 on the scalar kernels. 1e-4 is 4.5x the worst seen and still far below "
        "what a different token, penalty or temperature changes (>= 1e-2).")

LOGPROB_VS_HF = Tolerance(
    "logprobs vs transformers", atol=2e-3,
    why="Our engine's logprobs vs an independent transformers forward pass over the same tokens: different "
        "kernels (fused attention with a paged KV cache, our GEMV, a fused decoder stack) along every layer, and "
        "the KV of earlier tokens computed in other batch shapes (prefill chunks, decode steps) rather than in "
        "one pass. 2e-3 has held on every CPU path the suite has run on; a wrong position, mask or temperature "
        "moves a logprob by 1e-1 or more.")

PROB_MASS_FP32 = Tolerance(
    "probability mass, fp32", atol=1e-5,
    why="The sum of a float32 softmax's probabilities over up to ~50k entries: torch sums with a cascade "
        "(pairwise) scheme, error ~log2(V) u = 1e-6, plus ~3 ulp of rounding per probability (exp, divide), "
        "~2e-7 of the total mass. 1e-5 keeps ~8x margin.")

SECONDS_FP64 = Tolerance(
    "seconds, fp64", atol=1e-6,
    why="A duration in seconds (<= 1e4) computed in float64 along two routes (a simulation's sums of up to 1e5 "
        "steps vs a closed form, a least-squares fit on exact data): rounding stays below gamma_n * sum|t| = "
        "1e5 * 1.1e-16 * 1e4 = 1e-7; 1e-6 bounds it and is far below any modelled cost (>= 1e-3 s). Absolute, "
        "since the expected value may be exactly 0.")

BF16_ULP = 2.0**-7  # relative spacing of bfloat16 numbers in [1, 2): 8 significand bits


def bf16_ulps(n: int) -> Tolerance:
    """A bfloat16 result vs the float32 reference rounded to bfloat16, within ``n`` bf16 ulps: an ulp of
    |w| is at most BF16_ULP * |w|, so rtol = n * BF16_ULP covers n of them; atol = n * BF16_ULP covers
    values of order 1 that cancel. One ulp: round-to-nearest vs truncation (Triton's interpreter
    truncates fp32 -> bf16); two: an intermediate rounded to bf16 as the reference does."""
    return Tolerance(f"{n} bf16 ulp", why=bf16_ulps.__doc__ or "", atol=n * BF16_ULP, rtol=n * BF16_ULP)


# ---- bf16 and quantized-activation kernels ----------------------------------------------------------
# Bounds, not fixed tolerances: each follows the kernel's float sequence (see the kernel's docstring), so
# it is as tight on an output near 0 as on a large one, and holds on every ISA path.

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits, round to nearest even)


def bf16_rounding_bound(want: torch.Tensor | np.ndarray, roundings: int = 1) -> np.ndarray:
    """Bound on |got - want| for a bf16 result that rounds ``roundings`` times (to bf16, nearest even)
    from fp32 values equal to the reference's up to fp32 rounding: each rounding moves a value by at most
    U_BF16 of itself, and an earlier rounding's error is scaled by at most (1 + U_BF16) by the next."""
    return roundings * U_BF16 * np.abs(_f64(want)) * (1 + U_BF16) + 1e-30


def bf16_linear_error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                            exact: torch.Tensor | np.ndarray) -> np.ndarray:
    """Bound on |bf16 linear - exact| for bf16 x, w, b: the sum accumulated in fp32 (any order:
    linear_error_bound of the bf16 values, exactly representable in fp32), then one rounding to bf16
    of the result (``exact``: the float64 product of the same bf16 values)."""
    fp32 = linear_error_bound(x.float(), w.float(), None if b is None else b.float())
    return fp32 * (1 + U_BF16) + U_BF16 * np.abs(_f64(exact))


def bf16_attention_error_bound(exact: torch.Tensor | np.ndarray, v_abs_max: float, context: int,
                               head_dim: int) -> np.ndarray:
    """Bound on |bf16 attention - exact| for bf16 q, K, V: scores, softmax and the weighted sum of V in
    fp32 (each probability within ~8 gamma_(L + D) relative of its exact value: the score dot product,
    one exp of ~2 ulp, the normalising sum; the weighted sum of V adds gamma_L), then one rounding of
    the output to bf16. ``exact``: float64 attention over the same bf16 values."""
    return U_BF16 * np.abs(_f64(exact)) + 8 * gamma(context + head_dim) * v_abs_max + 1e-30


def _block_terms(x: torch.Tensor, codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """|dot_b| sx_b [T, N, B] and |sum(xq_b)| sx_b [T, B] in float64, for x quantized per block of 32
    as the kernels do (kernels/quant_linear.py, ``quantize_activations_ref``)."""
    from kernels.quant_formats import BLOCK
    from kernels.quant_linear import quantize_activations_ref

    T, (N, Kp) = x.shape[0], codes.shape
    xq, sx = quantize_activations_ref(x, Kp)
    xb = xq.double().view(T, -1, BLOCK)
    dots = torch.einsum("tbk,nbk->tnb", xb, codes.double().view(N, -1, BLOCK)).abs()  # [T, N, B]
    sxd = sx.double()
    return (dots * sxd[:, None, :]).numpy(), (xb.sum(-1).abs() * sxd).numpy()


def int8_linear_error_bound(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None) -> np.ndarray:
    """[T, N] bound on |int8_linear - int8_linear_ref| (int8 weights, int8 activations per block of 32).
    Both quantize x alike and every block dot dot_b (32 integer products) is exact; the kernel then runs
    acc = fma(dot_b, sx_b, acc) over the B blocks and y = fma(acc, sw, bias): B + 1 roundings of partial
    sums of |dot_b sx_b sw| and |bias|, so the bound is gamma_(B+2) times their sum."""
    terms, _ = _block_terms(x, qweight)
    s = terms.sum(-1) * np.abs(scales.double().numpy())[None, :]
    if bias is not None:
        s = s + np.abs(bias.double().numpy())[None, :]
    return gamma(terms.shape[-1] + 2) * s


def q4_linear_error_bound(x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                          bias: torch.Tensor | None = None) -> np.ndarray:
    """[T, N] bound on |q4_linear - q4_linear_ref| (Q4_1 weights, int8 activations per block of 32):
    acc = fma(dot_b * sx_b, d_b, acc); acc = fma(m_b, xs_b, acc) per block (xs_b = sx_b * sum(xq_b),
    rounded once), then acc + bias: at most 3B + 2 roundings of sums of |dot_b sx_b d_b|, |m_b xs_b|
    and |bias|."""
    from kernels.quant_formats import from_fp16_bits, unpack_q4

    terms, xs = _block_terms(x, unpack_q4(qweight))
    dd, mm = from_fp16_bits(d).double().abs().numpy(), from_fp16_bits(m).double().abs().numpy()  # [N, B]
    s = (terms * dd[None]).sum(-1) + xs @ mm.T
    if bias is not None:
        s = s + np.abs(bias.double().numpy())[None, :]
    return gamma(3 * terms.shape[-1] + 3) * s


INT8_ACTIVATIONS = Tolerance(
    "int8 activations vs the weight-only fp32 product", rmax=0.02,
    why="A kernel that quantizes x to int8 per block of 32 (sx = max|x| / 127) vs x @ dequant(W)^T in fp32: each "
        "element of x moves by at most sx / 2, i.e. 1/254 of its block's largest magnitude, with random signs, so "
        "over K terms the output moves by ~sqrt(K) (max|x| / 254) |w| -- about 0.3-0.5% of the largest output for "
        "random inputs of order 1 at K = 1536. 2% keeps ~4x margin; a wrong block scale or row is off by 10% or more.")


def estimate(want: Any, *, why: str, abs: float | None = None, rel: float | None = None) -> Any:
    """``pytest.approx`` for a quantity that is estimated rather than computed exactly: a rate measured on a
    sampled trace, a fitted coefficient, a quantization's accuracy cost. Its tolerance is the estimate's
    spread, not float rounding, and ``why`` says where its size comes from (tests/test_tolerance_usage.py
    requires one)."""
    import pytest

    assert len(why.strip()) >= 10, "estimate(): say why the tolerance has its size"
    return pytest.approx(want, abs=abs, rel=rel)
