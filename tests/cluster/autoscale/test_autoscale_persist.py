"""The autoscaler's state over a controller restart (cluster/autoscale/persist.py): a loop restored
from the dead one's snapshot, on another process' clock after a gap, decides exactly as the loop
that never stopped; one started fresh does not (its cooldowns are gone). The metrics window is
carried too: the first window after the restart equals the uninterrupted one. Clocks and ages are
whole seconds, so every time conversion is exact and the comparisons are ``==``."""

from __future__ import annotations

import copy
from dataclasses import replace

from cluster.autoscale.actuator import PoolStatus
from cluster.autoscale.loop import AutoscaleLoop, SLOAutoscaler
from cluster.autoscale.metrics import PrometheusWindows
from cluster.autoscale.persist import VERSION, standby_targets, state_from_json, state_to_json
from cluster.autoscale.profile import ReplicaCapacity, SLOTargets
from cluster.autoscale.slo import AutoscalerConfig, PoolScaling
from test_autoscale_loop import FakeMetrics, RecordingActuator
from test_autoscale_metrics import _router, _serve

CAP = ReplicaCapacity(requests_per_s=2.0, mean_prompt_tokens=100, mean_output_tokens=50)


class DictStore:
    """A StateStore in memory; ``save`` copies through JSON as the registry's Ray KV does."""

    def __init__(self) -> None:
        self.payload: dict | None = None
        self.saves = 0

    def save(self, payload: dict) -> bool:
        import json

        self.payload = json.loads(json.dumps(payload))
        self.saves += 1
        return True

    def load(self) -> dict | None:
        return self.payload


class Actuator(RecordingActuator):
    """RecordingActuator with a standby target, as the Ray actuator reports it."""

    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__(sizes)
        self.standby = dict.fromkeys(sizes, 0)

    def status(self, pool: str) -> PoolStatus:
        return replace(super().status(pool), standby_target=self.standby[pool])

    def set_standby(self, pool: str, replicas: int) -> None:
        self.calls.append((f"{pool} standby", replicas))
        self.standby[pool] = replicas


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _config() -> AutoscalerConfig:
    return AutoscalerConfig(pools=(PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=0.05), CAP, min_replicas=0,
                                               max_replicas=50, max_standby=3),),
                            scale_to_zero_after_s=120.0)


def _rate(t: float) -> float:
    return 20.0 if t < 200 else 0.0  # then idle: the pool goes to zero scale_to_zero_after_s after its last activity


def test_a_restored_loop_decides_as_the_uninterrupted_one_and_a_fresh_one_does_not():
    store = DictStore()
    act = Actuator({"decode": 1})
    mono, wall = Clock(0.0), Clock(1_000_000.0)
    loop = AutoscaleLoop(SLOAutoscaler(_config()), FakeMetrics(_rate), act, interval_s=10, clock=mono, wall=wall,
                         store=store)
    for t in range(0, 260, 10):  # scale up at t=0, idle from t=200 on: to zero at t=310
        mono.t, act.now = float(t), float(t)
        loop.step()
    assert act.calls[0][0] == "decode" and act.desired["decode"] > 1
    assert store.saves == 26 and store.payload["version"] == VERSION

    # the controller dies after the t=250 round; its successor restores 15 s later (wall clock), on a
    # process whose monotonic clock has another origin
    gap, origin = 15.0, 7_000.0
    new_act, fresh_act = copy.deepcopy(act), copy.deepcopy(act)  # the same pool, seen by each controller
    new_mono, new_wall = Clock(origin + 250.0 + gap), Clock(wall.t + gap)
    restored = AutoscaleLoop(SLOAutoscaler(_config()), FakeMetrics(lambda t: _rate(t - origin)), new_act,
                             interval_s=10, clock=new_mono, wall=new_wall, store=store)
    assert restored.restore()
    mem, want = restored.policy.state.of("decode"), loop.policy.state.of("decode")
    assert mem.last_up == want.last_up + origin and mem.offset == want.offset
    assert mem.standby.last_active == want.standby.last_active + origin

    ref_loop, ref_act = loop, act  # the loop that never stopped
    fresh = AutoscaleLoop(SLOAutoscaler(_config()), FakeMetrics(lambda t: _rate(t - origin)), fresh_act,
                          interval_s=10, clock=new_mono)
    seen_fresh, seen_ref = [], []
    for k in range(8):  # the rounds after the restart, up to and past the scale to zero
        t = 250.0 + gap + 10 * k
        ref_act.now, new_act.now, fresh_act.now = t, t, t
        new_mono.t = origin + t
        want_d = ref_loop.step(now=t)["decode"]
        got_d = restored.step()["decode"]
        assert (got_d.current, got_d.desired, got_d.offset, got_d.standby) == \
            (want_d.current, want_d.desired, want_d.offset, want_d.standby)
        assert got_d.reason == want_d.reason
        seen_ref.append(want_d.desired)
        seen_fresh.append(fresh.step()["decode"].desired)
    assert ref_act.calls == new_act.calls  # the same scale to zero, at the same moment
    assert seen_ref[0] > 0 and 0 in seen_ref  # idle for 65 s at the restart: to zero only later
    assert seen_fresh[0] == 0  # fresh: no activity remembered, to zero at once


def test_state_round_trips_never_and_standby_memory():
    loop = SLOAutoscaler(_config())
    act = Actuator({"decode": 2})
    loop.decide(100.0, FakeMetrics(_rate).windows(["decode"], 100.0), {"decode": act.status("decode")})
    state = loop.state
    data = state_to_json(state, 100.0)
    assert data["decode"]["last_down"] is None  # never: no scale-down yet
    assert state_from_json(data, 100.0) == state  # same clock, same moment: identical
    shifted = state_from_json(data, 5100.0)
    assert shifted.of("decode").last_up == state.of("decode").last_up + 5000.0
    assert shifted.of("decode").standby.risk == state.of("decode").standby.risk


def test_restore_refuses_another_version_and_standby_targets_follow_max_standby():
    store = DictStore()
    store.payload = {"version": VERSION + 1, "saved_at": 0.0}
    loop = AutoscaleLoop(SLOAutoscaler(_config()), FakeMetrics(_rate), Actuator({"decode": 1}), store=store)
    assert not loop.restore()
    assert not AutoscaleLoop(SLOAutoscaler(_config()), FakeMetrics(_rate), Actuator({"decode": 1})).restore()
    payload = {"version": VERSION, "saved_at": 0.0, "standby": {"decode": 5, "other": 2}}
    assert standby_targets(payload, _config()) == {"decode": 3}  # capped at max_standby; unknown pools left out
    no_standby = AutoscalerConfig(pools=(PoolScaling("decode", "decode", SLOTargets(tpot_p90_s=0.05), CAP),))
    assert standby_targets(payload, no_standby) == {}  # the autoscaler does not set this pool's standby count
    assert standby_targets(None, _config()) == {}


def test_the_metrics_window_goes_on_over_a_restart():
    """Readings restored into a new provider: its first window (across the gap) equals the one the
    provider that never stopped computes; a gap longer than the saved window restores nothing."""
    m, registry = _router(queued=2)
    first = PrometheusWindows([registry.collect], window_buckets=4, latency_buckets=2)
    for t in (0.0, 10.0, 20.0):
        _serve(m, 10, ttft=0.2, tpot=0.03)
        first.windows(["dec"], now=t)
    saved = DictStore()
    saved.save(first.snapshot(20.0))
    _serve(m, 30, ttft=0.4, tpot=0.06)  # served while no controller ran

    origin = 3_000.0
    second = PrometheusWindows([registry.collect], window_buckets=4, latency_buckets=2)
    second.restore(saved.load(), saved_at=origin + 20.0, now=origin + 30.0)
    got = second.windows(["dec"], now=origin + 30.0)["dec"]
    want = first.windows(["dec"], now=30.0)["dec"]
    assert got == want
    assert got.arrivals_rps[-1] == 3.0 and got.latency_samples == 40

    late = PrometheusWindows([registry.collect], window_buckets=4, latency_buckets=2)
    late.restore(saved.load(), saved_at=origin + 20.0, now=origin + 60.0)  # 40 s gap > the 20 s window
    assert late.windows(["dec"], now=origin + 60.0) == {}  # a first reading only: no window yet
