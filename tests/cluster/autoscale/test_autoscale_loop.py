"""The autoscaler control loop with a fake metrics provider and a recording actuator; the
queue-length baseline policy."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.loop import AutoscaleLoop, SLOAutoscaler
from cluster.autoscale.slo import AutoscalerConfig, PoolMetrics, PoolScaling
from cluster.autoscale.profile import ReplicaCapacity, SLOTargets
from cluster.autoscale.queue_length import QueueLengthAutoscaler, QueueScaling

CAP = ReplicaCapacity(requests_per_s=2.0, mean_prompt_tokens=100, mean_output_tokens=50)


class FakeMetrics:
    """Serves a scripted arrival rate (a function of time) per pool."""

    def __init__(self, rate, **extra) -> None:
        self.rate, self.extra, self.calls = rate, extra, []

    def windows(self, pools, now):
        self.calls.append((tuple(pools), now))
        return {p: PoolMetrics(bucket_s=10.0, arrivals_rps=[self.rate(now - 10.0 * k) for k in range(29, -1, -1)],
                               mean_prompt_tokens=100, mean_output_tokens=50, **self.extra) for p in pools}


class RecordingActuator:
    """Replicas start ``start_delay`` seconds of the loop's clock after being asked for."""

    def __init__(self, sizes: dict[str, int], start_delay: float = 0.0) -> None:
        self.desired = dict(sizes)
        self.ready_at: dict[str, list[float]] = {p: [0.0] * n for p, n in sizes.items()}
        self.start_delay = start_delay
        self.calls: list[tuple[str, int]] = []
        self.now = 0.0

    def status(self, pool: str) -> PoolStatus:
        times = self.ready_at[pool]
        ready = sum(t <= self.now for t in times)
        return PoolStatus(pool, self.desired[pool], ready, len(times) - ready, 0)

    def scale_to(self, pool: str, replicas: int) -> None:
        self.calls.append((pool, replicas))
        times = self.ready_at[pool]
        if replicas > len(times):
            times += [self.now + self.start_delay] * (replicas - len(times))
        else:
            del times[replicas:]
        self.desired[pool] = replicas


def slo_config() -> AutoscalerConfig:
    return AutoscalerConfig(pools=(
        PoolScaling("prefill", "prefill", SLOTargets(ttft_p90_s=0.5), CAP, max_replicas=50),
        PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=0.05), CAP, max_replicas=50),
        PoolScaling("draft", "drafter", follows="decode", ratio=1.0, min_replicas=0, max_replicas=50)))


def test_loop_applies_changes_only_and_records_decisions():
    act = RecordingActuator({"prefill": 1, "decode": 1, "draft": 1})
    loop = AutoscaleLoop(SLOAutoscaler(slo_config()), FakeMetrics(lambda t: 9.0), act, interval_s=10)
    d = loop.step(now=0.0)
    assert act.calls == [("prefill", 5), ("decode", 5), ("draft", 5)]
    assert loop.last is d and d["decode"].desired == 5
    loop.step(now=10.0)  # steady: nothing more to apply
    assert len(act.calls) == 3 and loop.num_steps == 2


def test_ramp_up_and_down_through_the_loop():
    """A ramp 2 -> 20 -> 2 req/s: the loop follows it up (not past max) and back down, in steps."""
    def rate(t):
        return 2.0 if t < 600 else 20.0 if t < 1800 else 2.0
    act = RecordingActuator({"prefill": 1, "decode": 1, "draft": 1}, start_delay=60.0)
    loop = AutoscaleLoop(SLOAutoscaler(slo_config()), FakeMetrics(rate), act, interval_s=10)
    sizes = []
    for i in range(400):
        act.now = 10.0 * i
        loop.step(now=act.now)
        sizes.append(act.desired["decode"])
    peak = max(sizes)
    assert 11 <= peak <= 13  # 20 req/s x 50 tok / 100 tok/s per replica x 1.1 = 11, forecast trend on the edge
    assert sizes[-1] < 4  # back down, after the down cooldowns
    downs = [b for a, b in zip(sizes, sizes[1:]) if b < a]
    assert len(downs) >= 3  # stepwise (max 10% per decision, cooldown between)
    assert [c for c in act.calls if c[0] == "draft"][-1] == ("draft", sizes[-1])


def test_loop_thread_runs_and_survives_a_failing_round():
    act = RecordingActuator({"prefill": 1, "decode": 1, "draft": 1})
    boom = {"n": 0}

    class Flaky(FakeMetrics):
        def windows(self, pools, now):
            boom["n"] += 1
            if boom["n"] == 1:
                raise ConnectionError("prometheus down")
            return super().windows(pools, now)

    done = threading.Event()
    loop = AutoscaleLoop(SLOAutoscaler(slo_config()), Flaky(lambda t: 9.0), act, interval_s=0.01)
    orig = loop.step

    def step(now=None):
        out = orig(now)
        done.set()
        return out
    loop.step = step  # type: ignore[method-assign]
    loop.start()
    try:
        assert done.wait(5.0)
    finally:
        loop.stop()
    assert loop.num_failures == 1 and act.desired["decode"] == 5


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        AutoscaleLoop(SLOAutoscaler(slo_config()), FakeMetrics(lambda t: 1.0), RecordingActuator({}), interval_s=0)


def test_queue_length_baseline_waits_its_delays():
    policy = QueueLengthAutoscaler((QueueScaling("main", target_ongoing_requests=2, max_replicas=20,
                                                 upscale_delay_s=30, downscale_delay_s=600),))
    act = RecordingActuator({"main": 2})
    busy = FakeMetrics(lambda t: 1.0, in_flight=12.0, queue_depth=8.0)  # 20 ongoing -> 10 replicas
    loop = AutoscaleLoop(policy, busy, act, interval_s=10)
    for t in (0, 10, 20):
        loop.step(now=float(t))
    assert act.desired["main"] == 2  # proposals "up" for 20 s < 30 s
    loop.step(now=30.0)
    assert act.desired["main"] == 10
    loop.provider = FakeMetrics(lambda t: 1.0, in_flight=4.0)  # 2 replicas' worth
    for t in range(40, 640, 10):
        loop.step(now=float(t))
    assert act.desired["main"] == 10  # 590 s below: still waiting
    loop.step(now=640.0)
    assert act.desired["main"] == 2


def test_real_clock_default():
    loop = AutoscaleLoop(SLOAutoscaler(slo_config()), FakeMetrics(lambda t: 1.0),
                         RecordingActuator({"prefill": 1, "decode": 1, "draft": 1}))
    before = time.monotonic()
    loop.step()
    assert loop.provider.calls[0][1] >= before
