"""Arrival traces for the cluster simulator: a seeded synthetic generator and public-trace readers.

A ``Trace`` is three aligned arrays, sorted by time: arrival time (seconds from the trace start),
prompt tokens and output tokens per request.

Synthetic (``synthetic_trace``): a non-homogeneous Poisson process whose rate is

    rate(t) = base_rps + (peak_rps - base_rps) * (1 - cos(2 pi (t - peak_at_s) / period_s + pi)) / 2
              x burst(t)

i.e. a diurnal cosine from ``base_rps`` (at ``peak_at_s`` - period/2) to ``peak_rps`` (at
``peak_at_s``), times bursts: burst starts arrive as a Poisson process of ``bursts_per_hour``; each
multiplies the rate by ``burst_factor`` for an exponentially distributed duration of mean
``burst_mean_s`` (overlapping bursts multiply). Arrivals are drawn by thinning (Lewis & Shedler):
candidates at the maximum rate, each kept with probability rate(t) / max. Prompt and output
lengths are log-normal with the given means and coefficient of variation ``cv`` (sigma^2 =
ln(1 + cv^2)), rounded and clipped to [1, max]. Everything comes from one numpy Generator seeded
with ``seed``: the same arguments give the same trace.

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


def synthetic_trace(*, duration_s: float, base_rps: float, peak_rps: float, period_s: float = 86400.0,
                    peak_at_s: float = 50400.0, bursts_per_hour: float = 2.0, burst_factor: float = 2.0,
                    burst_mean_s: float = 300.0, mean_prompt: float = 512.0, mean_output: float = 256.0,
                    cv: float = 1.0, max_prompt: int = 8192, max_output: int = 8192, seed: int = 0,
                    name: str = "synthetic") -> Trace:
    """The documented generator (module docstring)."""
    if not 0 <= base_rps <= peak_rps or peak_rps <= 0:
        raise ValueError(f"rates: need 0 <= base_rps ({base_rps}) <= peak_rps ({peak_rps}) and peak_rps > 0")
    if duration_s <= 0 or period_s <= 0 or burst_factor < 1 or burst_mean_s <= 0 or bursts_per_hour < 0:
        raise ValueError("duration_s, period_s, burst_mean_s must be > 0, burst_factor >= 1, bursts_per_hour >= 0")
    rng = np.random.default_rng(seed)
    n_b = rng.poisson(bursts_per_hour * duration_s / 3600.0)
    b_start = np.sort(rng.uniform(0.0, duration_s, n_b))
    b_end = b_start + rng.exponential(burst_mean_s, n_b)
    max_overlap = _max_overlap(b_start, b_end)
    lam_max = peak_rps * burst_factor ** max_overlap
    n_cand = rng.poisson(lam_max * duration_s)
    cand = np.sort(rng.uniform(0.0, duration_s, n_cand))
    rate = _diurnal(cand, base_rps, peak_rps, period_s, peak_at_s)
    active = np.searchsorted(b_start, cand, side="right") - np.searchsorted(np.sort(b_end), cand, side="right")
    rate = rate * burst_factor ** active
    keep = rng.uniform(0.0, lam_max, n_cand) < rate
    t = cand[keep]
    return Trace(name, t, _lognormal(rng, mean_prompt, cv, max_prompt, len(t)),
                 _lognormal(rng, mean_output, cv, max_output, len(t)))


def _diurnal(t: np.ndarray, base: float, peak: float, period: float, peak_at: float) -> np.ndarray:
    return base + (peak - base) * (1 - np.cos(2 * np.pi * (t - peak_at) / period + np.pi)) / 2


def _max_overlap(start: np.ndarray, end: np.ndarray) -> int:
    events = sorted([(s, 1) for s in start] + [(e, -1) for e in end])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _lognormal(rng: np.random.Generator, mean: float, cv: float, cap: int, n: int) -> np.ndarray:
    if cv <= 0:
        return np.full(n, max(1, min(cap, round(mean))), dtype=np.int64)
    sigma2 = math.log(1 + cv * cv)
    x = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


# ------------------------------------------------------------------------------ readers
def read_burstgpt(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """A BurstGPT CSV (module docstring)."""
    rows = _read_rows(path, ("Timestamp", "Request tokens", "Response tokens"))
    t, p, o = [], [], []
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
    t, p, o = [], [], []
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


def _num(path: str | os.PathLike[str], line: int, row: dict[str, str], col: str, kind: type) -> float | int:
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
