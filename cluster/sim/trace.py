"""Arrival traces for the cluster simulator: a seeded synthetic generator and public-trace readers.

A ``Trace`` is three aligned arrays, sorted by time: arrival time (seconds from the trace start),
prompt tokens and output tokens per request.

Synthetic (``synthetic_trace``): a non-homogeneous Poisson process whose rate is

    rate(t) = base_rps + (peak_rps - base_rps) * shape(u)  x  burst(t),   u = ((t - peak_at_s) / period_s) mod 1

with ``shape`` one of
    cosine      (1 + cos(2 pi u)) / 2: a diurnal cosine from ``base_rps`` (at ``peak_at_s`` -
                period/2) to ``peak_rps`` (at ``peak_at_s``) -- the default
    sawtooth    u: a linear ramp from base to peak over each period, then an instant drop back to
                base at ``peak_at_s`` (+ k periods)
    on_off      1 while u < ``duty``, else 0: a square wave, ``peak_rps`` for duty x period from
                ``peak_at_s`` on, ``base_rps`` the rest of each period
    piecewise   linear between ``knots`` = ((t_s, level in [0, 1]), ...) in time order, flat before
                the first and after the last (not periodic: ``period_s`` and ``peak_at_s`` are
                unused): any day profile, e.g. a long low night then a morning rise, or ramps
times bursts: random ones -- starts arrive as a Poisson process of ``bursts_per_hour``, each
multiplies the rate by ``burst_factor`` (or, with ``burst_factor_max``, by a factor drawn
uniformly from [burst_factor, burst_factor_max] per burst) for an exponentially distributed
duration of mean ``burst_mean_s`` -- and fixed ones, ``bursts`` = ((start_s, duration_s, factor), ...): a sharp
step of that factor at a known time. Overlapping bursts multiply. Arrivals are drawn by thinning
(Lewis & Shedler): candidates at the maximum rate, each kept with probability rate(t) / max.

Lengths (prompt and output alike, each clipped to [1, max] after rounding):
    lognormal   mean and coefficient of variation ``cv`` (sigma^2 = ln(1 + cv^2)) -- the default
    pareto      Pareto type I with tail index ``tail_alpha`` (> 1) and the given mean (scale =
                mean (alpha - 1) / alpha): P(X > x) ~ x^-alpha, a heavy tail (alpha < 2 has infinite
                variance; the clip to max then lowers the realised mean a little)
Everything comes from one numpy Generator seeded with ``seed``: the same arguments give the same
trace (and the defaults give the same trace as before the shapes and fixed bursts existed).

Readers (no download; point them at a local copy):
    BurstGPT (github.com/HPMLL/BurstGPT, ``BurstGPT_*.csv``): columns ``Timestamp`` (seconds from
        the trace start), ``Request tokens``, ``Response tokens`` (plus Model, Total tokens, Log
        Type, ignored). Rows with 0 response tokens (failed requests) are dropped.
    Azure LLM inference (github.com/Azure/AzurePublicDataset, ``AzureLLMInferenceTrace_*.csv``):
        ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``: date-time, up to 7 fractional digits),
        ``ContextTokens``, ``GeneratedTokens``. Times become seconds from the first row.

Example::

    tr = synthetic_trace(duration_s=86400, base_rps=5, peak_rps=40, seed=1)
    len(tr), tr.duration_s, tr.rate_series(60.0)[:3]
"""

from __future__ import annotations

import csv
import math
import os
from typing import TypeVar
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace file is missing a column or holds a bad row; the message names the file, row and column."""


@dataclass(frozen=True, eq=False)
class Trace:
    name: str
    t: np.ndarray  # [N] float64 arrival seconds, non-decreasing
    prompt: np.ndarray  # [N] int64 prompt tokens >= 1
    output: np.ndarray  # [N] int64 output tokens >= 1

    def __post_init__(self) -> None:
        assert self.t.shape == self.prompt.shape == self.output.shape, "trace arrays must align"
        assert len(self.t) == 0 or (np.all(np.diff(self.t) >= 0) and self.t[0] >= 0), "arrivals must be sorted"

    def __len__(self) -> int:
        return len(self.t)

    @property
    def duration_s(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0

    def rate_series(self, bucket_s: float) -> np.ndarray:
        """Arrivals per second in consecutive buckets of ``bucket_s`` from t = 0."""
        n = max(1, math.ceil(self.duration_s / bucket_s + 1e-9))
        return np.bincount((self.t // bucket_s).astype(np.int64), minlength=n)[:n] / bucket_s

    def slice(self, start_s: float, end_s: float) -> Trace:
        """Requests arriving in [start_s, end_s), re-timed to start at 0."""
        lo, hi = np.searchsorted(self.t, [start_s, end_s])
        return Trace(self.name, self.t[lo:hi] - start_s, self.prompt[lo:hi], self.output[lo:hi])


N = TypeVar("N", int, float)
SHAPES = ("cosine", "sawtooth", "on_off", "piecewise")
LENGTHS = ("lognormal", "pareto")


def synthetic_trace(*, duration_s: float, base_rps: float, peak_rps: float, period_s: float = 86400.0,
                    peak_at_s: float = 50400.0, bursts_per_hour: float = 2.0, burst_factor: float = 2.0,
                    burst_mean_s: float = 300.0, mean_prompt: float = 512.0, mean_output: float = 256.0,
                    cv: float = 1.0, max_prompt: int = 8192, max_output: int = 8192, seed: int = 0,
                    name: str = "synthetic", shape: str = "cosine", duty: float = 0.5,
                    bursts: Sequence[tuple[float, float, float]] = (), lengths: str = "lognormal",
                    tail_alpha: float = 2.0, knots: Sequence[tuple[float, float]] = (),
                    burst_factor_max: float | None = None) -> Trace:
    """The documented generator (module docstring). Raises ValueError naming a bad argument."""
    if not 0 <= base_rps <= peak_rps or peak_rps <= 0:
        raise ValueError(f"rates: need 0 <= base_rps ({base_rps}) <= peak_rps ({peak_rps}) and peak_rps > 0")
    if duration_s <= 0 or period_s <= 0 or burst_factor < 1 or burst_mean_s <= 0 or bursts_per_hour < 0:
        raise ValueError("duration_s, period_s, burst_mean_s must be > 0, burst_factor >= 1, bursts_per_hour >= 0")
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: must be one of {', '.join(SHAPES)}")
    if not 0 < duty <= 1:
        raise ValueError(f"duty={duty!r}: must be in (0, 1] (the on share of each on_off period)")
    if lengths not in LENGTHS:
        raise ValueError(f"lengths={lengths!r}: must be one of {', '.join(LENGTHS)}")
    if lengths == "pareto" and not tail_alpha > 1:
        raise ValueError(f"tail_alpha={tail_alpha!r}: must be > 1 (a Pareto tail with alpha <= 1 has no mean)")
    if shape == "piecewise" and (not knots or any(len(k) != 2 or not 0 <= k[1] <= 1 for k in knots)
                                 or any(b[0] <= a[0] for a, b in zip(knots, knots[1:]))):
        raise ValueError(f"knots={tuple(knots)!r}: shape='piecewise' needs ((t_s, level in [0, 1]), ...) "
                         "with strictly increasing t_s")
    if burst_factor_max is not None and not burst_factor_max >= burst_factor:
        raise ValueError(f"burst_factor_max={burst_factor_max!r}: must be >= burst_factor ({burst_factor}), or None")
    for i, b in enumerate(bursts):
        if len(b) != 3 or b[1] <= 0 or b[2] < 1:
            raise ValueError(f"bursts[{i}]={b!r}: must be (start_s, duration_s > 0, factor >= 1)")
    rng = np.random.default_rng(seed)
    n_b = rng.poisson(bursts_per_hour * duration_s / 3600.0)
    b_start = np.sort(rng.uniform(0.0, duration_s, n_b))
    b_end = b_start + rng.exponential(burst_mean_s, n_b)
    if burst_factor_max is not None:
        # Drawn only when asked for, so that traces without it keep their random stream (and values).
        b_factor = rng.uniform(burst_factor, burst_factor_max, n_b)
        fixed = np.asarray([*zip(b_start, b_end, b_factor), *((s, s + d, f) for s, d, f in bursts)],
                           dtype=np.float64).reshape(-1, 3)
        b_start = b_end = np.zeros(0)  # each random burst is now a fixed one with its own factor
    else:
        fixed = np.asarray([(s, s + d, f) for s, d, f in bursts], dtype=np.float64).reshape(-1, 3)
    lam_max = peak_rps * _max_multiplier(b_start, b_end, burst_factor, fixed)
    n_cand = rng.poisson(lam_max * duration_s)
    cand = np.sort(rng.uniform(0.0, duration_s, n_cand))
    rate = base_rps + (peak_rps - base_rps) * _shape(cand, shape, period_s, peak_at_s, duty, knots)
    active = np.searchsorted(b_start, cand, side="right") - np.searchsorted(np.sort(b_end), cand, side="right")
    rate = rate * burst_factor ** active
    for s, e, f in fixed:
        rate = np.where((cand >= s) & (cand < e), rate * f, rate)
    keep = rng.uniform(0.0, lam_max, n_cand) < rate
    t = cand[keep]
    draw = _lognormal if lengths == "lognormal" else _pareto
    spread = cv if lengths == "lognormal" else tail_alpha
    return Trace(name, t, draw(rng, mean_prompt, spread, max_prompt, len(t)),
                 draw(rng, mean_output, spread, max_output, len(t)))


def _shape(t: np.ndarray, shape: str, period: float, peak_at: float, duty: float,
           knots: Sequence[tuple[float, float]] = ()) -> np.ndarray:
    """The rate's shape in [0, 1] (module docstring)."""
    if shape == "piecewise":
        return np.interp(t, [k[0] for k in knots], [k[1] for k in knots])
    u = np.mod((t - peak_at) / period, 1.0)
    if shape == "cosine":
        return (1 + np.cos(2 * np.pi * u)) / 2
    if shape == "sawtooth":
        return u
    return (u < duty).astype(np.float64)


def _max_multiplier(start: np.ndarray, end: np.ndarray, factor: float, fixed: np.ndarray) -> float:
    """The largest product of burst factors active at any one time (random bursts multiply by
    ``factor`` each, fixed ones by their own): it is reached at some burst's start."""
    starts = np.concatenate([start, fixed[:, 0]])
    best = 1.0
    for s in starts:
        m = factor ** int(np.sum((start <= s) & (end > s)))
        m *= float(np.prod(fixed[(fixed[:, 0] <= s) & (fixed[:, 1] > s), 2]))
        best = max(best, m)
    return best


def _lognormal(rng: np.random.Generator, mean: float, cv: float, cap: int, n: int) -> np.ndarray:
    if cv <= 0:
        return np.full(n, max(1, min(cap, round(mean))), dtype=np.int64)
    sigma2 = math.log(1 + cv * cv)
    x = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def _pareto(rng: np.random.Generator, mean: float, alpha: float, cap: int, n: int) -> np.ndarray:
    # numpy's pareto is Lomax (Pareto II, support from 0): (1 + lomax) x scale is Pareto I.
    scale = mean * (alpha - 1) / alpha
    x = (1.0 + rng.pareto(alpha, n)) * scale
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


# ------------------------------------------------------------------------------ readers
def read_burstgpt(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """A BurstGPT CSV (module docstring)."""
    rows = _read_rows(path, ("Timestamp", "Request tokens", "Response tokens"))
    t: list[float] = []
    p: list[int] = []
    o: list[int] = []
    for line, row in rows:
        ts = _num(path, line, row, "Timestamp", float)
        req, resp = _num(path, line, row, "Request tokens", int), _num(path, line, row, "Response tokens", int)
        if resp <= 0:
            continue  # a failed request in the log: no output to serve
        t.append(ts)
        p.append(max(1, req))
        o.append(resp)
    return _build(name or Path(path).stem, t, p, o)


def read_azure(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """An Azure LLM inference trace CSV (module docstring)."""
    rows = _read_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    t: list[float] = []
    p: list[int] = []
    o: list[int] = []
    for line, row in rows:
        raw = row["TIMESTAMP"].strip()
        try:
            head, _, frac = raw.partition(".")
            stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)
        except ValueError:
            raise TraceError(f"{path}:{line}: TIMESTAMP={raw!r}: expected 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None
        t.append(stamp)
        p.append(max(1, _num(path, line, row, "ContextTokens", int)))
        o.append(max(1, _num(path, line, row, "GeneratedTokens", int)))
    return _build(name or Path(path).stem, t, p, o)


def _read_rows(path: str | os.PathLike[str], needed: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields = [h.strip() for h in reader.fieldnames or []]
            missing = [c for c in needed if c not in fields]
            if missing:
                raise TraceError(f"{path}: missing column(s) {missing}; found {fields}")
            return [(i + 2, {k.strip(): v for k, v in row.items() if k is not None}) for i, row in enumerate(reader)]
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None


def _num(path: str | os.PathLike[str], line: int, row: dict[str, str], col: str, kind: type[N]) -> N:
    raw = (row.get(col) or "").strip()
    try:
        return kind(float(raw)) if kind is int else kind(raw)
    except ValueError:
        raise TraceError(f"{path}:{line}: {col}={raw!r}: expected a number") from None


def _build(name: str, t: list[float], p: list[int], o: list[int]) -> Trace:
    ta = np.asarray(t, dtype=np.float64)
    order = np.argsort(ta, kind="stable")
    ta = ta[order] - (ta.min() if len(ta) else 0.0)
    return Trace(name, ta, np.asarray(p, dtype=np.int64)[order], np.asarray(o, dtype=np.int64)[order])
