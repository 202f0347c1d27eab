"""Serving metrics from per-request stream timings, with the definitions vLLM's benchmark uses.

Terms (all times in seconds on one monotonic clock, per request):
    send        when the client issued the call
    chunk i     the i-th streamed message that carried at least one token id, received at t_i
    TTFT        t_0 - send                                    (time to first token)
    E2E         t_last - send                                 (end-to-end latency)
    TPOT        (E2E - TTFT) / (n_out - 1), for n_out > 1     (time per output token after the first)
    ITL         t_i - t_(i-1) for every i >= 1                (inter-token latency, one value per gap;
                                                              a chunk with k > 1 tokens is one gap)
    goodput     requests meeting every given SLO (TTFT, TPOT, E2E) per second of the run
    throughput  completed requests, output tokens and prompt+output tokens per second of the run
    duration    first send to last completion

Example::

    r = RequestRecord(send=0.0, chunk_times=[0.05, 0.07, 0.09], chunk_tokens=[1, 1, 1], prompt_tokens=10)
    r.ttft, r.tpot, r.itls   # 0.05, 0.02, [0.02, 0.02]
    summarize([r], SLO(ttft_s=0.1, tpot_s=0.05))["goodput_rps"]   # 1 / 0.09 s
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one streamed request did. ``error`` is a gRPC status name + message when it failed."""

    send: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class SLO:
    """Per-request service-level objectives in seconds; None = not constrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        if self.tpot_s is not None and tpot is not None and tpot > self.tpot_s:
            return False
        return self.e2e_s is None or r.e2e <= self.e2e_s


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 of ``values`` in milliseconds."""
    out = {"mean_ms": (sum(values) / len(values) * 1e3) if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = percentile(values, q) * 1e3
    return out


def summarize(records: list[RequestRecord], slo: SLO) -> dict[str, Any]:
    """Every metric of the module docstring for one run, as a JSON-ready dict."""
    ok = [r for r in records if r.ok]
    if records:
        start = min(r.send for r in records)
        end = max((r.chunk_times[-1] for r in ok), default=start)
        duration = max(end - start, 1e-9)
    else:
        duration = math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "no tokens").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput_rps": len(ok) / duration,
        "output_throughput_tps": out_tokens / duration,
        "total_token_throughput_tps": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "goodput_rps": sum(slo.met(r) for r in ok) / duration,
        "slo": {"ttft_ms": _ms(slo.ttft_s), "tpot_ms": _ms(slo.tpot_s), "e2e_ms": _ms(slo.e2e_s)},
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl": distribution([gap for r in ok for gap in r.itls]),
        "e2e": distribution([r.e2e for r in ok]),
        "output_tokens": out_tokens,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
