"""Arrival-rate estimation for the SLO autoscaler (cluster/autoscale/slo.py, step 1 of its docstring).

Two windows over the same per-bucket arrival rates (oldest first):

long window     Holt's linear smoothing over every bucket: a level and a trend. For a pool whose
                requests stay long (``smoothing_s`` > 0: decode, seconds to minutes) the level has
                that time constant, alpha = 1 - exp(-bucket_s / smoothing_s): the pool needs capacity
                for its concurrency, the arrival rate averaged over one residence, not for one bucket.
short window    the last ``short_window_s`` (k buckets; at most a third of the window). A *burst*
                is the mean of the last j <= k buckets above the level by more than ``burst_sigmas``
                standard errors for some j (noise = max(Poisson: sqrt(rate / (j bucket_s)), the
                buckets' own spread / sqrt(j))): one bucket catches a sharp step at once, k buckets
                a smaller one. Then the level is not trusted (it lags a step by its time constant)
                and the largest such mean (the one holding the least of the time before the step)
                is the rate to plan for. A pool whose new replicas take ``horizon_s`` to
                start and whose requests stay less than that needs, by then, capacity for the rate
                arriving then -- the short mean is the best estimate of it, the lagging level is not.

level           Holt's level, never above the window's busiest bucket and, with the short window
                on, never below its quietest bucket: Holt overshoots a step both ways (after a
                drop its falling trend carries the level below what still arrives)
rise            growth expected over the horizon: Holt's trend x horizon less 2 sigma of its noise,
                at most the growth seen across the window at its own pace (a step is not a ramp).
                With the short window on, growth must also be *confirmed*: each of the last three
                short means above the one before by more than the noise, and the rise is at most the
                smaller of the two increases, at that pace, over the horizon. A step rises once and
                is then flat, so it is never extrapolated (Holt's trend after a 4x step would add
                another ~1.4x on top); a ramp rises in every short window and is.

burst cap       a pool fed by another (a decode pool behind its prefill pool) plans a burst for at
                most what the feeding pool admits (``burst_cap``, its own forecast): when a
                prefill pool that fell behind catches up, it releases its backlog into the
                decode pool in one or two buckets at several times the real arrival rate. That
                backlog is a batch of requests (the level, the pool's concurrency, counts them),
                not a rate that will go on arriving; planned for as one, it sizes the pool for
                several times what comes next, and the scale-down waits then hold that size.
forecast        max(level, short mean if burst) + rise: what scale-up sizes for.
noise           the level's standard error under Poisson arrivals, sqrt(level / bucket_s x
                alpha / (2 - alpha)): the autoscaler scales up on a forecast (not a burst) only
                past what the pool is sized for by more than this (cluster/autoscale/slo.py step 2).
upper           max(forecast, the busiest point of the last ``stabilise_s``: the busiest bucket, or
                the peak level for a smoothing pool): what must fit before anything is removed --
                Kubernetes' scale-down stabilisation window, in load space.

With ``short_window_s`` = 0 and ``stabilise_s`` >= the window, this is the single-window estimate
the autoscaler used before (kept for comparison: benchmarks/autoscale_traces.py runs it).

Worked examples (buckets of 10 s, alpha 0.5, beta 0.3):
  a ramp, horizon 60 s, short window 20 s: rates [8, 8, 9, 10, 11, 12] -> Holt level 11.4, rise
    6 x 0.72 - 2 x 1.08 = 2.15; the short means 8, 9.5, 11.5 rise by 1.5 and 2.0, over the noise
    0.76 (sqrt(11.5 / 20)): confirmed, and 1.5 per 20 s over 60 s = 4.5 does not bind. Not a
    burst (11.5 is the level). Forecast 11.4 + 2.15 = 13.6.
  a step, same settings: [8, 8, 8, 8, 32, 32] -> level 27.8; short means 8, 8, 32: the rise is
    not confirmed (flat, then one jump): forecast 27.8, where Holt alone says 34.2.
  a step in a decode pool (smoothing_s 60 s, horizon 120 s, short window 30 s): 20 buckets at 8
    then 2 at 32 -> the level is 14.7; the last bucket's 32 is far over 14.7 + 4 x sqrt(32 / 10):
    a burst, forecast 32 (Holt alone: 17.4, two minutes before it catches up).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def holt_forecast(series: Sequence[float], alpha: float, beta: float) -> tuple[float, float, float, float, float]:
    """Holt's linear smoothing over ``series``: (level, trend per step, sigma, peak level, lowest
    level) after the last value. sigma = RMS of the one-step-ahead forecast errors (the noise as
    the model sees it); peak / lowest level = the extremes of the level along the way. The level
    starts at the first value (alpha >= 0.5) or at the series mean (slower smoothing, which a
    single first value would bias); trend at 0."""
    levels, trend, sigma = holt_levels(series, alpha, beta)
    if not levels:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    return levels[-1], trend, sigma, max(levels), min(levels)


def holt_levels(series: Sequence[float], alpha: float, beta: float) -> tuple[list[float], float, float]:
    """(the level after each value, the last trend, sigma) of Holt's smoothing (``holt_forecast``)."""
    if not series:
        return [], 0.0, 0.0
    level = float(series[0]) if alpha >= 0.5 else sum(series) / len(series)
    trend, sq, levels = 0.0, 0.0, [level]
    for x in series[1:]:
        prev = level
        sq += (x - (level + trend)) ** 2
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - prev) + (1 - beta) * trend
        levels.append(level)
    return levels, trend, math.sqrt(sq / max(len(series) - 1, 1))


@dataclass(frozen=True)
class RateEstimate:
    """The module docstring's quantities, in requests per second."""

    level: float
    short: float
    burst: bool
    rise: float
    forecast: float
    upper: float
    noise: float = 0.0  # standard error of the level under Poisson arrivals


def estimate_rates(rates: Sequence[float], bucket_s: float, *, horizon_s: float, alpha: float, beta: float,
                   smoothing_s: float = 0.0, short_window_s: float = 0.0, burst_sigmas: float = 4.0,
                   stabilise_s: float = math.inf, burst_cap: float = math.inf) -> RateEstimate:
    """The two-window estimate of the module docstring. burst_cap: the most a burst is planned
    for (a pool fed by another can be sent no more than that one admits)."""
    if not rates:
        return RateEstimate(0.0, 0.0, False, 0.0, 0.0, 0.0)
    base_alpha = alpha
    if smoothing_s > 0 and bucket_s > 0:
        alpha = 1 - math.exp(-bucket_s / smoothing_s)
        beta = beta * alpha / base_alpha
    levels, trend, sigma = holt_levels(rates, alpha, beta)
    if smoothing_s > 0:
        sigma *= math.sqrt(alpha / (2 - alpha))  # the noise of the smoothed level, not of one bucket
    steps = horizon_s / bucket_s if bucket_s > 0 else 0.0
    lo, hi = (min(levels), max(levels)) if smoothing_s > 0 else (min(rates), max(rates))
    span = (hi - lo) * steps / len(rates)  # growth seen, at this pace
    rise = min(max(0.0, trend * steps - 2 * sigma), span)
    level = min(levels[-1], max(rates))  # Holt overshoots a step; never past what was seen
    short, burst = level, False
    k = min(round(short_window_s / bucket_s), len(rates) // 3) if short_window_s > 0 and bucket_s > 0 else 0
    if k >= 1:
        n = len(rates)
        level = max(level, min(rates[n - k:]))  # nor below what the short window saw (Holt's undershoot)
        s2, s1, short = (sum(rates[n - (j + 1) * k:n - j * k]) / k for j in (2, 1, 0))
        # A burst: the mean of the last j <= k buckets above the level by burst_sigmas standard
        # errors, for some j (one bucket catches a sharp step at once, k catch a smaller one);
        # plan for the largest such mean (the window that holds the least of the time before).
        means = [sum(rates[n - j:]) / j for j in range(1, k + 1)]
        high = [mj for j, mj in enumerate(means, 1)
                if mj > level + burst_sigmas * _noise(rates[:n - k], max(mj, level), j, bucket_s)]
        burst = bool(high)
        short = max(high) if high else short
        if burst:
            short = max(level, min(short, burst_cap))
            burst = short > level  # capped to the level: nothing beyond what it already counts
        grew = min(sum(rates[n - k:]) / k - s1, s1 - s2)
        rise = min(rise, grew / (k * bucket_s) * horizon_s) if grew > _noise(rates[:n - k], max(s1, level), k,
                                                                               bucket_s) else 0.0
    forecast = max(0.0, (max(level, short) if burst else level) + rise)
    recent = len(rates) if math.isinf(stabilise_s) else max(1, math.ceil(stabilise_s / bucket_s - 1e-9))
    busiest = max(levels[-recent:]) if smoothing_s > 0 else max(rates[-recent:])
    # An exponential average with weight alpha over buckets of Poisson counts at rate r has
    # variance r / bucket_s x alpha / (2 - alpha).
    noise = math.sqrt(max(level, 0.0) / bucket_s * alpha / (2 - alpha)) if bucket_s > 0 else 0.0
    return RateEstimate(level, short, burst, rise, forecast, max(forecast, busiest), noise)


def _noise(before: Sequence[float], rate: float, k: int, bucket_s: float) -> float:
    """Standard error of a k-bucket mean rate: Poisson at ``rate``, or the spread the buckets
    before the short window show (half the mean squared step between neighbours: a ramp's steady
    growth does not count as noise), whichever is larger."""
    poisson = math.sqrt(max(rate, 0.0) / (k * bucket_s))
    if len(before) < 2:
        return poisson
    var = sum((b - a) ** 2 for a, b in zip(before, before[1:])) / (2 * (len(before) - 1))
    return max(poisson, math.sqrt(var / k))
