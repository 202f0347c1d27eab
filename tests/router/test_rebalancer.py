"""The rebalancer's policy (router/rebalancer.py ``plan``) on fake load numbers: it moves one
request from the hottest to the coolest worker of a pool when KV usage (or TPOT) diverges past the
threshold, picks the request that evens them best without inverting them, and its hysteresis keeps
requests from bouncing; plus its loop against a fake directory (the Migrate call it makes)."""

from __future__ import annotations

import asyncio

import grpc

from router.rebalancer import Move, RebalanceSettings, RebalanceState, Rebalancer, WorkerLoad, plan

S = RebalanceSettings(kv_gap=0.3, tpot_ratio=2.0, request_cooldown_s=30.0, pair_cooldown_s=5.0)


def w(wid, used, requests=(), tpot=None, total=100, pool="decode"):
    return WorkerLoad(wid, pool, used, total, 16, tpot, tuple(requests))


def test_moves_the_request_that_evens_the_pair_without_crossing():
    # w0 90% (a: 40 blocks, b: 20 blocks, c: 2 blocks), w1 20%: a would make w1 the hotter; b is best
    hot = w("w0", 90, [("a", 40 * 16), ("b", 20 * 16), ("c", 2 * 16)])
    moves = plan([hot, w("w1", 20), w("w2", 50)], S, RebalanceState(), now=100.0)
    assert moves == [Move("b", "w0", "w1", "KV usage 90% vs 20%")]


def test_below_the_threshold_or_a_lone_request_nothing_moves():
    assert plan([w("w0", 45, [("a", 320), ("b", 32)]), w("w1", 20)], S, RebalanceState(), 0.0) == []
    assert plan([w("w0", 95, [("a", 1500)]), w("w1", 0)], S, RebalanceState(), 0.0) == []  # min_running
    assert plan([w("w0", 90, [("a", 320), ("b", 32)])], S, RebalanceState(), 0.0) == []  # one worker
    # no candidate fits: both would leave the cool worker hotter than the hot one
    assert plan([w("w0", 70, [("a", 60 * 16), ("b", 55 * 16)]), w("w1", 10)], S, RebalanceState(), 0.0) == []


def test_pools_are_balanced_separately():
    loads = [w("a0", 90, [("x", 320), ("y", 320)], pool="a"), w("b0", 20, pool="b"), w("a1", 80, pool="a")]
    assert plan(loads, S, RebalanceState(), 0.0) == []  # a's workers are close; b0 is another pool


def test_tpot_divergence_triggers_a_move():
    loads = [w("w0", 50, [("a", 10 * 16), ("b", 5 * 16)], tpot=0.090), w("w1", 40, tpot=0.030)]
    [move] = plan(loads, S, RebalanceState(), 0.0)
    assert (move.source, move.target, move.reason) == ("w0", "w1", "TPOT 90.0 ms vs 30.0 ms")


def test_hysteresis_no_bounce_and_cooldowns():
    state = RebalanceState()
    loads = [w("w0", 90, [("a", 20 * 16), ("b", 20 * 16), ("c", 20 * 16)]), w("w1", 20)]
    [first] = plan(loads, S, state, now=0.0)
    state.record(first, 0.0)
    assert plan(loads, S, state, now=1.0) == []  # the pair waits for reports to show the move
    # reports caught up: w0 70%, w1 40%: gap 0.3 is not above the threshold
    after = [w("w0", 70, [(r, 320) for r in ("a", "b", "c") if r != first.request_id]), w("w1", 40, [(first.request_id, 320)])]
    assert plan(after, S, state, now=10.0) == []
    # w1 becomes the hot one later: the request moved to it is not sent back within its cooldown
    back = [w("w1", 95, [(first.request_id, 320), ("d", 320)]), w("w0", 10, [("e", 16)])]
    [move] = plan(back, S, state, now=20.0)
    assert move.request_id == "d"
    state.moved_requests["d"] = 20.0
    assert plan(back, S, state, now=21.0) == [] and plan(back, S, state, now=60.0)


class FakeStub:
    def __init__(self, fail: bool):
        self.calls, self.fail = [], fail

    async def Migrate(self, request, timeout=None):
        self.calls.append((request.request_id, request.target.worker_id))
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="no room")


class FakeDirectory:
    def __init__(self, loads, fail=False):
        self.loads, self.stubs = loads, {x.worker_id: FakeStub(fail) for x in loads}

    def rebalance_view(self):
        return self.loads

    def stub_of(self, wid):
        return self.stubs[wid]

    def migration_target(self, wid):
        from protos.duet.worker.v1 import worker_pb2
        return worker_pb2.MigrationTarget(worker_id=wid, endpoint=f"{wid}:1")


def test_the_loop_asks_the_source_to_migrate_and_counts():
    loads = [w("w0", 90, [("a", 320), ("b", 320)]), w("w1", 10)]
    ok = Rebalancer(FakeDirectory(loads), S, interval_s=1.0, clock=lambda: 0.0)
    assert [m.request_id for m in asyncio.run(ok.round())] == ["a"]
    assert ok.directory.stubs["w0"].calls == [("a", "w1")] and ok.counts == {"rebalance_moves": 1, "rebalance_failures": 0}
    bad = Rebalancer(FakeDirectory(loads, fail=True), S, interval_s=1.0, clock=lambda: 0.0)
    assert asyncio.run(bad.round()) == [] and bad.counts["rebalance_failures"] == 1
    assert asyncio.run(bad.round()) == []  # the failed pair waits out its cooldown
    assert len(bad.directory.stubs["w0"].calls) == 1
