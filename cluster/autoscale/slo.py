"""The SLO autoscaler's decision: metrics window + SLOs + capacity profile -> desired replicas.

``decide`` is a pure function: the same inputs give the same decisions, and it does no I/O. The
control loop (cluster/autoscale/loop.py) feeds it live metrics and applies the result through a
PoolActuator; the simulator (cluster/sim/simulator.py) feeds it simulated metrics. Both call this code.

Terms (per pool):
    window      the last few buckets of ``bucket_s`` seconds: arrival rate per bucket, the p90 TTFT
                and TPOT of requests observed in the window, queue depth, requests in flight
    capacity    what one replica sustains within the SLOs (a ReplicaCapacity from the profile)
    current     ``PoolStatus.desired``: what was last asked for (ready + starting + pending +
                whatever is being drained away). Starting replicas are counted (coming capacity),
                pending ones are not capacity but are already asked for: asking again would not
                place them, so they are reported in the reason instead
    offset      the reactive correction, in replicas, carried in the autoscaler's state

The algorithm, per pool (prefill, decode and colocated pools independently; drafters follow):
 1. Estimate the arrival rate (cluster/autoscale/forecast.py): a long window -- Holt's linear
    smoothing over every bucket (level alpha, trend beta -- or, for a pool with ``smoothing_s``,
    a level time constant of that many seconds) -- and a short one, the last ``short_window_s``.
    A *burst* (a short mean ``burst_sigmas`` standard errors over the level) is planned for at
    once instead of waiting for the level to catch up; a rise counts only beyond the noise, only
    when every short window confirms it (a step is not a ramp) and at most the window's own
    growth at its pace; a fall is never extrapolated (scale-down follows what happened):
    forecast = max(level, short if burst) + rise. upper = max(forecast, the busiest point of the
    stabilisation window: the busiest bucket, or the peak smoothed level for a pool with
    ``smoothing_s``) -- Kubernetes' scale-down stabilisation window, in load space. The window
    is the whole metrics window when scale-down drains, horizon_s + migration_s - smoothing_s
    when it migrates (step 4). Use a window of 20+ buckets (e.g. 5 minutes of 10 s). A decode
    pool ``fed_by`` a prefill pool plans a burst for at most that pool's forecast: a backlog the
    prefill pool releases when it catches up is a batch, not a rate.
 2. Predicted replicas: the pool's bottleneck work per second over one replica's capacity for it,
    with headroom: prefill pools count prompt tokens, decode pools output tokens, colocated pools
    the larger of the two (each against the profile's token rate at the SLO); with unknown token
    means, requests/s.  up_target = ceil(work(forecast) * (1 + headroom)), acted on only if
    the target at forecast - noise is above current too (noise = the level's standard error
    under Poisson arrivals, for a pool with ``smoothing_s``: a flicker of the level is no reason
    to grow; a burst or a breach needs no such check),  down_target = ceil(work(upper) * (1 + headroom + down_band)): the gap between them
    -- the noise, the band and the window's peak over its level -- is the hysteresis that keeps
    a noisy, steady load from flapping.
 3. Reactive correction: if a p90 exceeds ``breach_ratio`` x its SLO (or the queue holds more than
    ``queue_breach_per_replica`` requests per ready replica), set the offset so that the target is
    current + ``step`` (offset = max(offset, current - up_target) + step) -- unless replicas are
    starting (their capacity is on the way: wait for it), or arrived less than ``smoothing_s`` ago
    (a decode pool's TPOT is observed at completion, so for one residence time it still describes
    the pool before they came), or -- with ``hold_when_recovering`` -- the p90 is falling (below
    the last round's by 2%: the capacity came and the latency, observed at completion, is still
    catching up; adding more then would lock the overshoot in as an offset), or the last
    reactive step is younger than ``up_cooldown_s``. If every p90 is under ``slack_ratio`` x its SLO and the offset is positive,
    take ``step`` off it (same cadence); the offset never goes negative, because low latency at low
    load says nothing about the profile being wrong. A window with no arrivals, nothing running
    and nothing queued clears the offset: an idle pool gives no latency samples to show slack, and
    an offset kept through it would hold the pool above its predicted size for ever. step = max(1, round(reactive_step_frac x
    current)): +-1 on small pools, proportionally more on large ones.
 4. Desired: up_target + offset above current -> scale up at once (subject to ``up_cooldown_s``,
    except in a burst, which may grow every round); down_target + offset below current -> scale
    down, at most ``max_down_step_frac`` of the pool per decision, only if no SLO is breached,
    ``down_cooldown_s`` has passed since the last scale-up and ``down_interval_s`` since the last
    scale-down; cancelling pending replicas only (the target still covers every ready + starting
    replica) needs no cooldown. Clamp to [min_replicas, max_replicas]. (Level is also capped at
    the window's peak: Holt overshoots steps.) ``scale_down``: ``drain`` (a removed replica
    finishes its requests, minutes with long generations) keeps those waits; ``migrate`` (it
    moves them to the replicas that stay and is gone in ``migration_s``) caps each wait at what
    being wrong costs -- a replica removed too early is back after a start-up, ~horizon_s, so
    holding one longer than horizon_s + migration_s is never worth it (ski rental's break-even):
    stabilisation window and cooldown <= horizon_s + migration_s, interval <= migration_s. The
    smoothed level of a pool with ``smoothing_s`` already holds a past peak for about that long
    (an average over smoothing_s forgets a drop at that pace), so its window is the rest:
    max(0, horizon_s + migration_s - smoothing_s).
 5. Drafter pools, after the pool drafting on them (their lead): on draft demand (rows drafting,
    and requests that found no room, per lead replica x the lead's desired, over ``rows_per_replica``) and on measured benefit
    (acceptance x target step time vs draft round latency: a pool whose drafting does not pay
    shrinks toward its minimum); without draft metrics, ``ceil(ratio x`` the lead's desired``)``.
    cluster/autoscale/drafter.py has the model and a worked example.
 6. Standby replicas (a pool with ``max_standby`` > 0; cluster/autoscale/standby.py): as many as the
    burst risk the pool saw lately needs (how far the forecast rose above the window's mean before
    the last ``horizon_s``: load that came faster than a start-up, in replicas, remembered as a
    decaying maximum), at most ``max_standby``; their cost (``standby_cost`` serving replicas each)
    is in the reason. A scale-up promotes them first.
 7. Scale to zero (``min_replicas`` 0): the pool is sized as with a minimum of 1 while it is used,
    goes to 0 after ``scale_to_zero_after_s`` idle, and stays there until a request arrives (the
    router wakes it through the controller at once; the next round sees the activity and holds it).

Worked example (decode pool, capacity 1.6 req/s at 64 output tokens = 102.4 tok/s per replica,
headroom 0.1, band 0.1, horizon 60 s, buckets of 10 s). Arrival rates [8, 8, 9, 10, 11, 12] req/s
at 64 output tokens: Holt gives level 11.4, trend 0.72/bucket and sigma 1.08, so the forecast
6 buckets ahead is 11.4 + 6 x 0.72 - 2 x 1.08 = 13.6 req/s -> work 13.6 x 64 / 102.4 = 8.5
replicas -> up_target ceil(8.5 x 1.1) = 10. With current = 8 (6 ready, 2 starting) the decision
is "scale up 8 -> 10". Had the p90 TPOT been 2x the SLO with those 2 replicas still starting,
the reactive step would wait for them instead of adding more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.drafter import DraftWindow, demand_replicas, draft_speedup
from cluster.autoscale.forecast import RateEstimate, estimate_rates, holt_forecast  # noqa: F401 (re-exported)
from cluster.autoscale.profile import ReplicaCapacity, SLOTargets
from cluster.autoscale.standby import StandbyMemory, burst_risk, idle, standby_count

ROLES = ("prefill", "decode", "colocated", "drafter")
SCALE_DOWN = ("drain", "migrate")
NEVER = -math.inf
RECOVERY_MARGIN = 0.02  # a p90 / SLO this much below the last round's is recovering, not noise


class AutoscalerConfigError(ValueError):
    """A bad autoscaler setting; the message names the key, the value and what to change."""


@dataclass(frozen=True)
class PoolScaling:
    """How one pool scales. role: prefill (TTFT) | decode (TPOT) | colocated (both) | drafter
    (follows ``follows``, the decode or colocated pool drafting on it, at ``ratio`` drafters per
    replica of that pool).

    smoothing_s: the time constant of the arrival-rate level, ~ the time a request spends in the
    pool (decode: output tokens x TPOT). A pool whose requests stay minutes needs capacity for
    its concurrency -- the arrival rate averaged over that residence -- not for a 10-second spike;
    0 = react per bucket with ``holt_alpha`` (prefill pools, whose requests stay sub-second).
    headroom: this pool's headroom (None = the config's): a pool that is a small share of the
    cost (prefill, next to long decodes) can cheaply hold enough spare to ride out a burst while
    new replicas start.
    fed_by: for a decode pool, the prefill pool whose output is its input (None = not known):
    a burst the decode pool sees is planned for at most that pool's forecast (step 1).
    max_standby: the most standby replicas (step 6) the autoscaler keeps; 0 = it leaves the
    pool's standby count alone. standby_cost: one standby replica's cost in serving replicas.
    Drafter pools (step 5, cluster/autoscale/drafter.py): rows_per_replica: rows one replica
    batches within a round latency that pays (None: follow ``ratio`` only); min_speedup: the
    measured speed-up under which drafting does not pay and the pool shrinks to its minimum;
    verify_token_cost: a verified draft token's cost in a target step, per plain decode row;
    min_verifies: verifies a window needs before its speed-up is judged."""

    pool: str
    role: str
    slo: SLOTargets = SLOTargets()
    capacity: ReplicaCapacity | None = None
    min_replicas: int = 1
    max_replicas: int = 16
    follows: str | None = None
    ratio: float = 1.0
    smoothing_s: float = 0.0
    headroom: float | None = None
    fed_by: str | None = None
    max_standby: int = 0
    standby_cost: float = 0.1
    rows_per_replica: float | None = None
    min_speedup: float = 1.1
    verify_token_cost: float = 0.05
    min_verifies: int = 100


@dataclass(frozen=True)
class AutoscalerConfig:
    """Global knobs (module docstring, steps 1-4) and the pools. Validated on construction."""

    pools: tuple[PoolScaling, ...]
    horizon_s: float = 60.0
    holt_alpha: float = 0.5
    holt_beta: float = 0.3
    headroom: float = 0.1
    down_band: float = 0.1
    breach_ratio: float = 1.0
    slack_ratio: float = 0.6
    queue_breach_per_replica: float = 8.0
    min_latency_samples: int = 20
    reactive_step_frac: float = 0.05
    max_down_step_frac: float = 0.2
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 300.0
    down_interval_s: float = 60.0
    short_window_s: float = 30.0
    burst_sigmas: float = 4.0
    hold_when_recovering: bool = True
    scale_down: str = "drain"
    migration_s: float = 10.0
    standby_memory_s: float = 3600.0
    scale_to_zero_after_s: float = 300.0

    def __post_init__(self) -> None:
        _validate(self)

    def pool(self, name: str) -> PoolScaling:
        return next(p for p in self.pools if p.pool == name)


def _validate(c: AutoscalerConfig) -> None:
    def need(ok: bool, key: str, value: object, fix: str) -> None:
        if not ok:
            raise AutoscalerConfigError(f"autoscaler.{key}={value!r}: {fix}")

    need(len(c.pools) >= 1, "pools", c.pools, "list at least one pool to scale")
    for key in ("horizon_s", "up_cooldown_s", "down_cooldown_s", "down_interval_s", "headroom", "down_band",
                "queue_breach_per_replica", "short_window_s", "burst_sigmas", "migration_s", "standby_memory_s",
                "scale_to_zero_after_s"):
        need(getattr(c, key) >= 0, key, getattr(c, key), "must be >= 0")
    need(c.scale_down in SCALE_DOWN, "scale_down", c.scale_down,
         "must be drain (removed replicas finish their requests) or migrate (they move them away)")
    for key in ("holt_alpha", "holt_beta", "reactive_step_frac", "max_down_step_frac"):
        need(0 < getattr(c, key) <= 1, key, getattr(c, key), "must be in (0, 1]")
    need(c.breach_ratio > c.slack_ratio > 0, "slack_ratio", c.slack_ratio,
         f"must be > 0 and below breach_ratio ({c.breach_ratio}); the gap is the reactive dead band")
    need(c.min_latency_samples >= 1, "min_latency_samples", c.min_latency_samples, "must be >= 1")
    names = [p.pool for p in c.pools]
    need(len(set(names)) == len(names), "pools", names, "pool names must be unique")
    for i, p in enumerate(c.pools):
        k = f"pools[{i}]"
        need(p.role in ROLES, f"{k}.role", p.role, f"must be one of {', '.join(ROLES)}")
        need(p.headroom is None or p.headroom >= 0, f"{k}.headroom", p.headroom, "must be >= 0 or unset")
        need(p.smoothing_s >= 0, f"{k}.smoothing_s", p.smoothing_s, "must be >= 0 seconds (0 = per bucket)")
        need(p.max_standby >= 0, f"{k}.max_standby", p.max_standby, "must be >= 0 (0 = leave the standby count alone)")
        need(p.standby_cost >= 0, f"{k}.standby_cost", p.standby_cost, "must be >= 0 (serving replicas per standby)")
        need(0 <= p.min_replicas <= p.max_replicas, f"{k}.min_replicas", p.min_replicas,
             f"must be between 0 and max_replicas ({p.max_replicas})")
        if p.role == "drafter":
            dec = next((q for q in c.pools if q.pool == p.follows), None)
            need(dec is not None and dec.role in ("decode", "colocated"), f"{k}.follows", p.follows,
                 "must name a decode or colocated pool of this config "
                 f"({[q.pool for q in c.pools if q.role in ('decode', 'colocated')]})")
            need(p.ratio > 0, f"{k}.ratio", p.ratio, "must be > 0 (drafter replicas per decode replica)")
            need(p.rows_per_replica is None or p.rows_per_replica > 0, f"{k}.rows_per_replica", p.rows_per_replica,
                 "must be > 0 (drafting requests one replica batches) or unset (follow ratio only)")
            need(p.min_speedup >= 0, f"{k}.min_speedup", p.min_speedup, "must be >= 0 (0: never judged not to pay)")
            need(p.verify_token_cost >= 0, f"{k}.verify_token_cost", p.verify_token_cost, "must be >= 0")
            need(p.min_verifies >= 1, f"{k}.min_verifies", p.min_verifies, "must be >= 1")
            continue
        if p.fed_by is not None:
            src = next((q for q in c.pools if q.pool == p.fed_by), None)
            need(p.role == "decode" and src is not None and src.role == "prefill", f"{k}.fed_by", p.fed_by,
                 f"must name a prefill pool of this config ({[q.pool for q in c.pools if q.role == 'prefill']}) "
                 "and be set on a decode pool only")
        need(p.capacity is not None, f"{k}.capacity", None, "needs a capacity profile (`duet profile`)")
        if p.role in ("prefill", "colocated"):
            need(p.slo.ttft_p90_s is not None, f"{k}.slo.ttft_p90_s", None, f"a {p.role} pool needs a TTFT target")
        if p.role in ("decode", "colocated"):
            need(p.slo.tpot_p90_s is not None, f"{k}.slo.tpot_p90_s", None, f"a {p.role} pool needs a TPOT target")


@dataclass(frozen=True)
class PoolMetrics:
    """One pool's metrics window (see cluster/autoscale/loop.py MetricsProvider for the sources).

    arrivals_rps: arrival rate per bucket, oldest first. ttft/tpot_p90_s: over requests observed in
    the window (None = none observed); latency_samples: how many. queue_depth: requests admitted
    and waiting for this pool; in_flight: requests running on it (both window means). draft: a
    drafter pool's rows and a target pool's speculation counters (cluster/autoscale/drafter.py)."""

    bucket_s: float
    arrivals_rps: Sequence[float]
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    latency_samples: int = 0
    queue_depth: float = 0.0
    in_flight: float = 0.0
    draft: DraftWindow | None = None  # speculation / drafter numbers (None: not read; step 5)


@dataclass(frozen=True)
class PoolMemory:
    last_up: float = NEVER  # time of the last scale-up (or down) this autoscaler asked for
    last_down: float = NEVER
    last_reactive: float = NEVER
    last_starting: float = NEVER  # last decision that saw replicas starting
    offset: int = 0
    last_ratio: float | None = None  # the worst p90 / SLO the last round saw (None: too few samples)
    standby: StandbyMemory = StandbyMemory()  # steps 6 and 7


@dataclass(frozen=True)
class AutoscalerState:
    pools: Mapping[str, PoolMemory] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, pool: str) -> PoolMemory:
        return self.pools.get(pool, PoolMemory())


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    desired: int
    reason: str
    forecast_rps: float = 0.0
    predicted: int = 0  # up_target before the reactive offset and bounds
    offset: int = 0
    capacity_replicas: int = 0  # ready + starting: what serves now or soon
    pending: int = 0  # asked for, not placed: not capacity
    standby: int | None = None  # standby replicas to keep (step 6); None = leave the count alone
    standby_current: int = 0  # the standby target the actuator had

    @property
    def standby_changed(self) -> bool:
        return self.standby is not None and self.standby != self.standby_current

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def decide(config: AutoscalerConfig, now: float, metrics: Mapping[str, PoolMetrics],
           status: Mapping[str, PoolStatus], state: AutoscalerState) -> tuple[dict[str, Decision], AutoscalerState]:
    """Desired replicas for every pool of ``config`` (module docstring), and the next state.
    Raises KeyError naming a pool that has no metrics or no status."""
    decisions: dict[str, Decision] = {}
    memory = dict(state.pools)
    for p in config.pools:
        if p.role == "drafter":
            continue
        if p.pool not in metrics or p.pool not in status:
            raise KeyError(f"pool {p.pool!r}: no {'metrics' if p.pool not in metrics else 'status'} this tick")
        cap = math.inf
        if p.fed_by is not None and p.fed_by in metrics:  # step 1's burst cap: what the feeding pool admits
            cap = _rates(config, config.pool(p.fed_by), metrics[p.fed_by]).forecast
        decisions[p.pool], memory[p.pool] = _decide_pool(config, p, now, metrics[p.pool], status[p.pool],
                                                         state.of(p.pool), cap)
    for p in config.pools:
        if p.role == "drafter":
            decisions[p.pool], memory[p.pool] = _decide_drafter(config, p, now, metrics, status[p.pool],
                                                                decisions[p.follows], state.of(p.pool))  # type: ignore[index]
    return decisions, AutoscalerState(MappingProxyType(memory))


def _decide_drafter(c: AutoscalerConfig, p: PoolScaling, now: float, metrics: Mapping[str, PoolMetrics],
                    st: PoolStatus, lead: Decision, mem: PoolMemory) -> tuple[Decision, PoolMemory]:
    """Step 5 (cluster/autoscale/drafter.py): draft demand, measured benefit, or the prior ratio."""
    current = st.desired
    mine, theirs = metrics.get(p.pool), metrics.get(lead.pool)
    drafted, spec = (mine.draft if mine else None), (theirs.draft if theirs else None)
    if p.rows_per_replica is None or drafted is None:
        want = _clamp(math.ceil(p.ratio * lead.desired - 1e-9), p)
        why = (f"follows {lead.pool} x{p.ratio:g} ({lead.desired} -> {want})" if p.rows_per_replica is None else
               f"no draft metrics: prior ratio x{p.ratio:g} of {lead.pool} ({lead.desired} -> {want})")
        return Decision(p.pool, current, want, why, capacity_replicas=st.capacity_replicas, pending=st.pending), mem
    headroom = c.headroom if p.headroom is None else p.headroom
    wanted = drafted.rows + drafted.unserved
    need_n = demand_replicas(wanted, lead.capacity_replicas, lead.desired, p.rows_per_replica, headroom)
    notes = [f"{drafted.rows:.1f} rows" + (f" + {drafted.unserved:.1f} unserved" if drafted.unserved else "") +
             f" over {lead.capacity_replicas} {lead.pool} replicas, {lead.pool} -> "
             f"{lead.desired}: {need_n} replicas at {p.rows_per_replica:g} rows each"]
    speedup = draft_speedup(spec, p.verify_token_cost) if spec is not None and spec.verifies >= p.min_verifies else None
    saturated = wanted > p.rows_per_replica * max(st.ready, 1)
    if speedup is not None:
        notes.append(f"speed-up {speedup:.2f}x (E {spec.tokens_per_verify:.2f}, k {spec.drafts_per_verify:.2f}, "  # type: ignore[union-attr]
                     f"wait {spec.wait_share:.0%})")  # type: ignore[union-attr]
    target = _clamp(need_n, p)
    if speedup is not None and speedup < p.min_speedup and not saturated:
        target = p.min_replicas
        notes.append(f"drafting does not pay (< {p.min_speedup:g}x): toward min {p.min_replicas}")
    desired = current
    if target > current:
        desired = target
        mem = replace(mem, last_up=now)
        notes.append(f"scale up {current} -> {desired}")
    elif target < current:
        wait = max(mem.last_up + c.down_cooldown_s, mem.last_down + c.down_interval_s) - now
        if target >= st.ready + st.starting:
            desired = target
            notes.append(f"cancel {current - desired} pending")
        elif wait > 0:
            notes.append(f"down cooldown ({wait:.0f} s left)")
        else:
            desired = max(target, current - max(1, math.ceil(c.max_down_step_frac * current)))
            mem = replace(mem, last_down=now)
            notes.append(f"scale down {current} -> {desired}")
    else:
        notes.append("hold")
    return Decision(p.pool, current, desired, "; ".join(notes), capacity_replicas=st.capacity_replicas,
                    pending=st.pending), mem


def _clamp(n: int, p: PoolScaling) -> int:
    return max(p.min_replicas, min(p.max_replicas, n))


def work_replicas(p: PoolScaling, m: PoolMetrics, rps: float) -> float:
    """Replicas' worth of the pool's bottleneck work at ``rps`` requests/s (step 2)."""
    cap = p.capacity
    assert cap is not None
    parts = []
    if p.role in ("prefill", "colocated") and m.mean_prompt_tokens > 0 and cap.prompt_tokens_per_s > 0:
        parts.append(rps * m.mean_prompt_tokens / cap.prompt_tokens_per_s)
    if p.role in ("decode", "colocated") and m.mean_output_tokens > 0 and cap.output_tokens_per_s > 0:
        parts.append(rps * m.mean_output_tokens / cap.output_tokens_per_s)
    return max(parts) if parts else rps / cap.requests_per_s


def _latency_ratio(c: AutoscalerConfig, p: PoolScaling, m: PoolMetrics) -> float | None:
    """The worst observed p90 / SLO over the pool's targets (None: too few samples to judge)."""
    if m.latency_samples < c.min_latency_samples:
        return None
    ratios = []
    if p.role in ("prefill", "colocated") and m.ttft_p90_s is not None:
        ratios.append(m.ttft_p90_s / p.slo.ttft_p90_s)  # type: ignore[operator]
    if p.role in ("decode", "colocated") and m.tpot_p90_s is not None:
        ratios.append(m.tpot_p90_s / p.slo.tpot_p90_s)  # type: ignore[operator]
    return max(ratios) if ratios else None


def _rates(c: AutoscalerConfig, p: PoolScaling, m: PoolMetrics, burst_cap: float = math.inf) -> RateEstimate:
    """Step 1 of the module docstring (cluster/autoscale/forecast.py)."""
    return estimate_rates(m.arrivals_rps, m.bucket_s, horizon_s=c.horizon_s, alpha=c.holt_alpha, beta=c.holt_beta,
                          smoothing_s=p.smoothing_s, short_window_s=c.short_window_s, burst_sigmas=c.burst_sigmas,
                          stabilise_s=_down_waits(c, p)[0], burst_cap=burst_cap)


def _down_waits(c: AutoscalerConfig, p: PoolScaling) -> tuple[float, float, float]:
    """(stabilisation window, cooldown after a scale-up, interval between scale-downs) in seconds.
    Draining is slow and a drained replica is only back after a start-up, so a drain waits long:
    the whole metrics window, ``down_cooldown_s``, ``down_interval_s``. A migration frees a replica
    in ``migration_s``; holding one that is not needed is worth it only while it could be needed
    again sooner than a new one starts (the horizon, = the start-up time): ski rental's
    break-even, so each wait is at most horizon_s + migration_s, and the next step down waits for
    the last one's migrations (migration_s). The stabilisation window of a pool whose level
    averages over ``smoothing_s`` is shorter by that much: after a drop, the level itself holds
    the old load for ~smoothing_s (the replica-seconds an exponential average keeps of a step are
    its time constant), and the two holds together make the break-even."""
    if c.scale_down == "migrate":
        keep = c.horizon_s + c.migration_s
        return max(0.0, keep - p.smoothing_s), min(c.down_cooldown_s, keep), min(c.down_interval_s, c.migration_s)
    return math.inf, c.down_cooldown_s, c.down_interval_s


def _reactive(c: AutoscalerConfig, p: PoolScaling, now: float, m: PoolMetrics, st: PoolStatus, mem: PoolMemory,
              up_target: int, notes: list[str]) -> tuple[bool, PoolMemory]:
    """Step 3 of the module docstring: (SLO breached?, memory with the new offset)."""
    current = st.desired
    step = max(1, round(c.reactive_step_frac * max(current, 1)))
    ratio = _latency_ratio(c, p, m)
    queue_breach = st.ready > 0 and m.queue_depth > c.queue_breach_per_replica * st.ready
    breach = (ratio is not None and ratio > c.breach_ratio) or queue_breach
    was = mem.last_ratio
    recovering = (c.hold_when_recovering and ratio is not None and was is not None
                  and ratio < was * (1 - RECOVERY_MARGIN) and not queue_breach)
    if ratio is not None:
        mem = replace(mem, last_ratio=ratio)
    if breach:
        what = f"p90/SLO {ratio:.2f}" if ratio is not None and ratio > c.breach_ratio else f"queue {m.queue_depth:.0f}"
        if st.starting > 0:
            notes.append(f"breach ({what}), waiting for {st.starting} starting")
        elif now - mem.last_starting < p.smoothing_s:
            notes.append(f"breach ({what}), latency still from before the last replicas arrived")
        elif recovering:
            notes.append(f"breach ({what}), recovering (was {was:.2f} last round)")
        elif now - mem.last_reactive >= c.up_cooldown_s:
            # Re-anchor on what is asked now: a breach always means current + step, even when the
            # profile-based target sits below current (the profile over-estimates capacity).
            mem = replace(mem, offset=max(mem.offset, current - up_target) + step, last_reactive=now)
            notes.append(f"breach ({what}): +{step} over current")
        else:
            notes.append(f"breach ({what}), reactive cooldown")
    elif (ratio is not None and ratio < c.slack_ratio and mem.offset > 0
          and now - mem.last_reactive >= c.up_cooldown_s):
        mem = replace(mem, offset=max(0, mem.offset - step), last_reactive=now)
        notes.append(f"slack (p90/SLO {ratio:.2f}): offset -{step}")
    elif mem.offset > 0 and not any(m.arrivals_rps) and m.in_flight == 0 and m.queue_depth == 0:
        mem = replace(mem, offset=0)
        notes.append("idle window: offset cleared")
    return breach, mem


def _decide_pool(c: AutoscalerConfig, p: PoolScaling, now: float, m: PoolMetrics, st: PoolStatus,
                 mem: PoolMemory, burst_cap: float = math.inf) -> tuple[Decision, PoolMemory]:
    est = _rates(c, p, m, burst_cap)
    forecast = est.forecast
    headroom = c.headroom if p.headroom is None else p.headroom
    up_target = math.ceil(work_replicas(p, m, forecast) * (1 + headroom) - 1e-9)
    # Scale up on evidence: the pool grows only if it would at the forecast less one standard
    # error of the level (a burst passed its own test). Otherwise every upward flicker of the
    # level adds replicas that the scale-down then holds for its window, and the pool rides the
    # top of its noise. When it grows, it grows to up_target. A burst or an SLO breach is
    # evidence enough.
    # Only for a pool whose level averages over its residence (smoothing_s > 0): a per-bucket
    # pool (prefill: sub-second requests, few cheap replicas) is meant to follow each bucket, and
    # holding its growth back by a bucket's noise delays it at the onset of every step.
    noise = est.noise if p.smoothing_s > 0 else 0.0
    evident = math.ceil(work_replicas(p, m, max(0.0, forecast - noise)) * (1 + headroom) - 1e-9)
    down_target = math.ceil(work_replicas(p, m, est.upper) * (1 + headroom + c.down_band) - 1e-9)
    _, down_cooldown_s, down_interval_s = _down_waits(c, p)
    current = st.desired
    notes: list[str] = []
    breach, mem = _reactive(c, p, now, m, st, mem, up_target, notes)
    offset = mem.offset
    want_up, want_down = _clamp(up_target + offset, p), _clamp(down_target + offset, p)
    desired = current
    if want_up > current and (est.burst or breach or _clamp(evident + offset, p) > current):
        if now - mem.last_up >= c.up_cooldown_s or est.burst:  # a burst grows every round: follow it
            desired = want_up
            mem = replace(mem, last_up=now)
            notes.append(f"scale up {current} -> {desired}")
        else:
            notes.append(f"up cooldown ({c.up_cooldown_s - (now - mem.last_up):.0f} s left)")
    elif want_down < current:
        if want_down >= st.ready + st.starting:  # only pending replicas go: nothing serving is removed
            desired = want_down
            notes.append(f"cancel {current - desired} pending")
        elif breach:
            notes.append("hold: SLO breached")
        elif (wait := max(mem.last_up + down_cooldown_s, mem.last_down + down_interval_s) - now) > 0:
            notes.append(f"down cooldown ({wait:.0f} s left)")
        else:
            desired = max(want_down, current - max(1, math.ceil(c.max_down_step_frac * current)))
            mem = replace(mem, last_down=now)
            notes.append(f"scale down {current} -> {desired}" + (" (migrate)" if c.scale_down == "migrate" else ""))
    else:
        notes.append("hold")
    if st.pending:
        notes.append(f"{st.pending} pending (no room; not counted as capacity)")
    mem = replace(mem, last_starting=now if st.starting else mem.last_starting)
    desired, standby, sm = _standby_and_zero(c, p, now, m, st, mem.standby, est, headroom, desired, notes)
    mem = replace(mem, standby=sm)
    burst = f" (burst: {est.short:.2f} over level {est.level:.2f})" if est.burst else ""
    reason = f"forecast {forecast:.2f} req/s{burst} -> {up_target} replicas, offset {offset:+d}; " + "; ".join(notes)
    return Decision(p.pool, current, desired, reason, forecast, up_target, offset, st.capacity_replicas,
                    st.pending, standby, st.standby_target), mem


def _standby_and_zero(c: AutoscalerConfig, p: PoolScaling, now: float, m: PoolMetrics, st: PoolStatus,
                      sm: StandbyMemory, est: RateEstimate, headroom: float, desired: int,
                      notes: list[str]) -> tuple[int, int | None, StandbyMemory]:
    """Steps 6 and 7 (cluster/autoscale/standby.py): (desired, standby or None, memory)."""
    to_zero = p.min_replicas == 0
    if to_zero:
        active = not idle(m.arrivals_rps, m.in_flight, m.queue_depth, st.starting)
        if active:
            sm = replace(sm, last_active=now)
        if st.desired == 0 and not active:
            desired = 0  # asleep: a request wakes it (the router, through the controller)
            notes.append("at zero (idle)")
        elif active:
            desired = max(desired, 1)
        elif now - sm.last_active >= c.scale_to_zero_after_s:
            desired = 0
            notes.append(f"idle {now - sm.last_active:.0f} s: scale to zero")
        else:
            desired = max(desired, 1)
    if p.max_standby <= 0:
        return desired, None, sm
    k = max(1, math.ceil(c.horizon_s / m.bucket_s))  # a start-up's worth of buckets
    before = m.arrivals_rps[:-k]
    base = sum(before) / len(before) if before else est.forecast
    rise = max(0.0, work_replicas(p, m, est.forecast) - work_replicas(p, m, base)) * (1 + headroom)
    risk = burst_risk(sm, now, rise, c.standby_memory_s)
    sm = replace(sm, risk=risk, risk_at=now)
    standby = standby_count(risk, p.max_standby, to_zero=to_zero)
    notes.append(f"standby {standby} (burst risk {risk:.1f} replicas, cost {standby * p.standby_cost:.2f} replicas)")
    return desired, standby, sm
