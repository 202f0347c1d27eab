"""The registry (cluster/deploy/registry.py) on the session's Ray cluster, and a controller restart
with tiny fake worker actors (no model; the real worker's restart is tests/e2e/test_controller_restart_e2e.py):
a standby replica is recorded as one and adopted as one -- the successor keeps it loaded and
unrouted, not promoted by the adoption -- and it is promoted as before, which is recorded; the
autoscaler's state blob is written only under the lease and dropped with it."""

from __future__ import annotations

import uuid

import pytest
import ray
from ray.util.placement_group import placement_group

from cluster.config.duet import PoolSection
from cluster.deploy.controller import Controller
from cluster.deploy.pools import Replica, WorkerPool, create_pool
from cluster.deploy.ray_actuator import RayActuator
from cluster.deploy.registry import Registry, ReplicaRecord
from test_standby import _factory, _states
from testkit.waiting import wait_until

NAMESPACE = "duet_standby_test"  # test_standby's fakes are named in it


def test_records_standby_flag_and_state_blob_under_the_lease(ray_cluster):
    reg = Registry(f"duet_registry_test_{uuid.uuid4().hex[:8]}")
    reg.record(ReplicaRecord("decode", 3, "decode-3", own_placement_group="pg-3", standby=True))
    reg.record(ReplicaRecord("decode", 1, "decode-1", slot=0))
    assert [(r.worker_id, r.standby) for r in reg.records("decode")] == [("decode-1", False), ("decode-3", True)]

    store = reg.state_store("autoscaler")
    assert not store.save({"version": 1}) and store.load() is None  # no lease held: nothing written
    reg.acquire(wait_s=1.0)
    try:
        assert reg.holds_lease() and store.save({"version": 1, "pools": {"decode": {"offset": 2}}})
        assert Registry(reg.namespace).state_store("autoscaler").load() == {"version": 1, "pools": {"decode": {"offset": 2}}}
        other = Registry(reg.namespace)  # a second controller: no lease, no write
        assert not other.holds_lease() and not other.state_store("autoscaler").save({"version": 1})
    finally:
        reg.release()
    assert store.load() is None  # a clean shutdown leaves no state to restore
    for r in reg.records():
        reg.forget(r.worker_id)


@pytest.fixture
def recorded_pool(ray_cluster):
    """A pool of one serving fake replica, recorded in a registry, under the pool placement group's
    name create_pool looks for when it adopts."""
    reg = Registry(NAMESPACE)
    section = PoolSection(name="fake", replicas=1, cpus_per_replica=1)
    base = placement_group([{"CPU": 1}], name=f"duet-{NAMESPACE}-fake")
    ray.get(base.ready(), timeout=60)
    pool = WorkerPool(section, NAMESPACE, base, [Replica("fake", 0, "fake-0", _factory("fake-0", base, 0)[0], slot=0)],
                      make_actors=_factory, registry=reg)
    try:
        yield reg, section, pool
    finally:
        pool.shutdown(grace=0)
        for r in reg.records():
            reg.forget(r.worker_id)


def test_an_adopted_standby_stays_standby_and_is_promoted_as_before(recorded_pool):
    reg, section, pool = recorded_pool
    first = Controller([pool], poll_interval_s=0.1)
    first.start()
    try:
        assert first.wait_ready(timeout=60)
        first.set_standby("fake", 1)
        wait_until(lambda: _states(first).get("fake-1") == "standby:standby", 60, "fake-1 loaded as a standby")
        assert [(r.worker_id, r.standby) for r in reg.records("fake")] == [("fake-0", False), ("fake-1", True)]
    finally:
        first.stop()  # the controller dies; the actors, placement groups and records stay

    # the successor adopts both replicas (found by name: nothing is created again)
    adopted = create_pool(section, None, NAMESPACE, embedded=False, registry=reg)
    assert [r.worker_id for r in adopted.replicas] == ["fake-0", "fake-1"]
    assert adopted.is_standby("fake-1") and not adopted.is_standby("fake-0")
    assert ray.get(adopted.replica("fake-1").actor.info.remote())["standby"]
    second = Controller([adopted], poll_interval_s=0.1)
    second.set_standby("fake", 1)  # what duet serve sets from the config (or the autoscaler's saved target)
    second.start()
    try:
        assert second.wait_ready(timeout=60)  # the serving replica only
        wait_until(lambda: _states(second) == {"fake-0": "up", "fake-1": "standby:standby"}, 60,
                   "fake-1 adopted as a standby")
        assert [w for w, _ in second.members()] == ["fake-0"]  # not promoted by the adoption
        assert ray.get(adopted.replica("fake-1").actor.info.remote())["standby"]  # start() was never called
        actuator = RayActuator([adopted], second, drain_grace_s=1.0, drain_settle_s=0.1)
        st = actuator.status("fake")
        assert (st.desired, st.ready, st.standby, st.standby_target) == (1, 1, 1, 1)

        actuator.scale_to("fake", 2)  # promotes the adopted standby
        wait_until(lambda: [w for w, _ in second.members()] == ["fake-0", "fake-1"], 60, "the promoted standby")
        assert second.num_promoted == 1
        assert ("fake-1", False) in [(r.worker_id, r.standby) for r in reg.records("fake")]  # recorded as serving
        wait_until(lambda: any(r.standby for r in reg.records("fake")), 30, "its replacement recorded as a standby")
    finally:
        second.stop()
        adopted.shutdown(grace=0)


def test_shared_adapters_are_kept_in_ray_for_the_next_controller(ray_cluster):
    """The membership service's shared adapter list (router/shared_adapters.py) in the registry's
    Ray KV: a successor's service starts with it, and a clean stop drops it."""
    from cluster.deploy.membership_service import MembershipServicer
    from protos.duet.control.v1 import control_pb2

    class Ctx:
        def abort(self, code, details):
            raise AssertionError(f"{code}: {details}")

    reg = Registry(f"duet_adapters_test_{uuid.uuid4().hex[:8]}")
    reg.acquire(wait_s=1.0)
    try:
        first = MembershipServicer(adapters_store=reg.state_store("adapters"))
        first.publish([("w0", "127.0.0.1:1")])
        first.PutAdapter(control_pb2.SharedAdapter(name="sql", source="/a/sql", base_model="m", pinned=True), Ctx())
        first.PutAdapter(control_pb2.SharedAdapter(name="chat", source="/a/chat", base_model="m"), Ctx())
        first.DeleteAdapter(control_pb2.DeleteAdapterRequest(name="chat"), Ctx())
        successor = MembershipServicer(adapters_store=Registry(reg.namespace).state_store("adapters"))
        successor.publish([("w0", "127.0.0.1:1")])
        got = successor._message.adapters
        assert got.revision == 3 and [(a.name, a.source, a.base_model, a.pinned) for a in got.adapters] == \
            [("sql", "/a/sql", "m", True)]
    finally:
        reg.release()
    assert Registry(reg.namespace).state_store("adapters").load() is None


def test_a_replica_adopted_mid_drain_finishes_its_drain(recorded_pool):
    """A scale-down in flight when the controller dies: the successor keeps the replica draining
    (listed as such at its endpoint, routed nothing new) until the recorded end of its drain, then
    stops and releases it; it is not counted as a live replica."""
    reg, section, pool = recorded_pool
    first = Controller([pool], poll_interval_s=0.1)
    first.start()
    try:
        assert first.wait_ready(timeout=60)
        first.add(pool.add_replica())
        wait_until(lambda: len(first.members()) == 2, 60, "fake-1 to serve")
        first.retire("fake-1", drain_grace_s=1.0, drain_settle_s=3.0)
        [draining] = [r for r in reg.records("fake") if r.drain_until is not None]
        assert draining.worker_id == "fake-1"
    finally:
        first.stop()  # the controller dies inside fake-1's settle time: its stop() was never sent

    adopted = create_pool(section, None, NAMESPACE, embedded=False, registry=reg)
    assert adopted.drain_until("fake-1") == draining.drain_until and adopted.drain_until("fake-0") is None
    second = Controller([adopted], poll_interval_s=0.1)
    second.start()
    try:
        assert second.wait_ready(1, timeout=60)
        actuator = RayActuator([adopted], second, drain_grace_s=1.0, drain_settle_s=0.1)
        assert actuator.status("fake").desired == 1  # fake-1 is on its way out: no live replica
        wait_until(lambda: [(m[0], m[4]) for m in second.member_details()] == [("fake-0", False), ("fake-1", True)],
                   30, "fake-1 listed draining at its endpoint")
        assert [w for w, _ in second.members()] == ["fake-0"]
        wait_until(lambda: "fake-1" not in _states(second), 30, "fake-1 released once its drain time is up")
        assert [r.worker_id for r in reg.records("fake")] == ["fake-0"]
        assert second.num_drained == 1
    finally:
        second.stop()
        adopted.shutdown(grace=0)
