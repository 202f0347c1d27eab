"""The autoscaler's control loop: every ``interval_s``, read metrics, decide, apply, log.

The loop owns no logic of its own: a ``MetricsProvider`` says what the pools saw, a
``ScalingPolicy`` (``SLOAutoscaler`` over cluster/autoscale/slo.py's pure ``decide``, or the
queue-length baseline in cluster/autoscale/queue_length.py) says what they should be, and a
``PoolActuator`` (cluster/autoscale/actuator.py) makes it so. The simulator drives the same loop with a
simulated clock (``step(now)``); a deployment runs it on a thread (``start``/``stop``).

Metrics the live provider (cluster/autoscale/metrics.py, PrometheusWindows) reads from the
routers' exporter (router/request_metrics.py, router/prometheus.py; label ``pool``). Arrivals are
counted where requests enter a pool, latencies where they are observed (the router streams them):

    duet_requests_arrived_total{pool}            counter   increase per bucket  -> arrivals_rps
    duet_request_prompt_tokens{pool}             histogram _sum / _count        -> mean_prompt_tokens
    duet_request_output_tokens{pool}             histogram _sum / _count        -> mean_output_tokens
    duet_time_to_first_token_seconds{pool}       histogram histogram_quantile(0.9) -> ttft_p90_s
    duet_time_per_output_token_seconds{pool}     histogram histogram_quantile(0.9) -> tpot_p90_s
                                                           (_count increase -> latency_samples)
    duet_requests_queued{pool}                   gauge     mean over readings -> queue_depth
    duet_requests_running{pool}                  gauge     mean over readings -> in_flight

A provider that has no window yet for some pool (the first round of a live provider) leaves that
round out: every pool holds.

Controller restarts: with a ``store`` (``duet serve`` on an existing Ray cluster passes the
registry's), each round ends by saving a snapshot -- the policy's memory, the provider's readings,
the standby targets -- and ``restore()`` before the first round takes them back, so cooldowns,
offsets and the metrics window go on where the dead controller left them
(cluster/autoscale/persist.py).

Every loop iteration logs one line per pool whose size changes (INFO) or holds (DEBUG), with the
decision's reason, and keeps the last decisions for ``duet status``-style inspection.

Example (what tests do, with fakes)::

    loop = AutoscaleLoop(SLOAutoscaler(config), provider, actuator, interval_s=10)
    loop.step(now=0.0)          # one decision round; returns {pool: Decision}
    loop.start(); ...; loop.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from cluster.autoscale.actuator import PoolActuator, PoolStatus
from cluster.autoscale.persist import VERSION, Persistent, StateStore, state_from_json, state_to_json
from cluster.autoscale.slo import AutoscalerConfig, AutoscalerState, Decision, PoolMetrics, decide

logger = logging.getLogger(__name__)


class MetricsProvider(Protocol):
    """The metrics window of each pool at time ``now`` (the loop's clock)."""

    def windows(self, pools: Sequence[str], now: float) -> Mapping[str, PoolMetrics]: ...


class ScalingPolicy(Protocol):
    """Stateful wrapper of a decision rule: desired replicas for every pool it scales."""

    pools: tuple[str, ...]

    def decide(self, now: float, metrics: Mapping[str, PoolMetrics],
               status: Mapping[str, PoolStatus]) -> dict[str, Decision]: ...


class SLOAutoscaler:
    """The SLO autoscaler (cluster/autoscale/slo.py) with its state carried between calls."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self.pools = tuple(p.pool for p in config.pools)
        self.state = AutoscalerState()

    def decide(self, now: float, metrics: Mapping[str, PoolMetrics],
               status: Mapping[str, PoolStatus]) -> dict[str, Decision]:
        decisions, self.state = decide(self.config, now, metrics, status, self.state)
        return decisions

    def snapshot(self, now: float) -> dict:
        return state_to_json(self.state, now)

    def restore(self, data: Mapping[str, Any], saved_at: float, now: float) -> None:
        self.state = state_from_json(data, saved_at)


class AutoscaleLoop:
    """Applies ``policy`` to ``actuator`` every ``interval_s`` seconds of ``clock``."""

    def __init__(self, policy: ScalingPolicy, provider: MetricsProvider, actuator: PoolActuator, *,
                 interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 store: StateStore | None = None, wall: Callable[[], float] = time.time) -> None:
        if not interval_s > 0:
            raise ValueError(f"autoscaler interval_s={interval_s!r}: must be > 0 seconds")
        self.policy, self.provider, self.actuator = policy, provider, actuator
        self.interval_s = interval_s
        self.clock = clock
        self.store, self.wall = store, wall  # snapshots for a restarted controller (None: not kept)
        self.num_save_failures = 0
        self.last: dict[str, Decision] = {}
        self.num_steps = 0
        self.num_failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, now: float | None = None) -> dict[str, Decision]:
        """One round: status + metrics -> decisions -> ``scale_to`` for each changed pool."""
        now = self.clock() if now is None else now
        pools = self.policy.pools
        status = {p: self.actuator.status(p) for p in pools}
        metrics = self.provider.windows(pools, now)
        if missing := [p for p in pools if p not in metrics]:
            logger.debug("autoscaler: no metrics window yet for %s; holding", ", ".join(missing))
            self.num_steps += 1
            self._save(now, {p: s.standby_target for p, s in status.items()})
            return {}
        decisions = self.policy.decide(now, metrics, status)
        for pool, d in decisions.items():
            if d.changed:
                self.actuator.scale_to(pool, d.desired)
                logger.info("autoscaler: %s %d -> %d (%s)", pool, d.current, d.desired, d.reason)
            else:
                logger.debug("autoscaler: %s holds %d (%s)", pool, d.current, d.reason)
            if d.standby_changed:
                self.actuator.set_standby(pool, d.standby)  # type: ignore[arg-type]
                logger.info("autoscaler: %s standby %d -> %d", pool, d.standby_current, d.standby)
        self.last = decisions
        self.num_steps += 1
        self._save(now, {p: d.standby if d.standby is not None else status[p].standby_target
                         for p, d in decisions.items()})
        return decisions

    # ---------------------------------------------------------------- restarts (cluster/autoscale/persist.py)
    def restore(self) -> bool:
        """Take the policy's memory and the provider's window from the store's snapshot (a
        restarted controller's, before its first round). False: no store, no snapshot, or one of
        another layout version."""
        payload = self.store.load() if self.store is not None else None
        if payload is None:
            return False
        if payload.get("version") != VERSION:
            logger.warning("autoscaler: not restoring a saved state of version %r (this one reads %d); starting "
                           "fresh", payload.get("version"), VERSION)
            return False
        elapsed = max(0.0, self.wall() - float(payload["saved_at"]))
        now = self.clock()
        for name, part in (("policy", self.policy), ("provider", self.provider)):
            if isinstance(part, Persistent) and name in payload:
                part.restore(payload[name], now - elapsed, now)  # the save's moment on this process' clock
        logger.info("autoscaler: restored the state saved %.0f s ago (%s)", elapsed,
                    ", ".join(n for n in ("policy", "provider") if n in payload) or "nothing to restore")
        return True

    def _save(self, now: float, standby: Mapping[str, int]) -> None:
        if self.store is None:
            return
        payload: dict[str, Any] = {"version": VERSION, "saved_at": self.wall(), "standby": dict(standby)}
        for name, part in (("policy", self.policy), ("provider", self.provider)):
            if isinstance(part, Persistent):
                payload[name] = part.snapshot(now)
        try:
            self.store.save(payload)
        except Exception as e:  # noqa: BLE001 - the GCS may be restarting (GCS FT): next round saves again
            self.num_save_failures += 1
            logger.warning("autoscaler: saving its state failed (%d so far): %r", self.num_save_failures, e)

    def start(self) -> None:
        """Run ``step`` every ``interval_s`` on a daemon thread until ``stop``."""
        assert self._thread is None, "AutoscaleLoop.start() called twice"
        self._thread = threading.Thread(target=self._run, name="duet-autoscaler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # a failed round (metrics source down, actuator error): log, try next time
                self.num_failures += 1
                logger.exception("autoscaler: decision round failed (%d so far); retrying in %.0f s",
                                 self.num_failures, self.interval_s)
