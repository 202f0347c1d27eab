"""The Ray actuator (cluster/deploy/ray_actuator.py) over a real pool, controller and placement groups on the
session's Ray cluster (2 CPUs), with tiny fake worker actors (no model): scale-up places a replica
in its own placement group, one that finds no room is pending (reported, not capacity) and is
cancelled first on scale-down; a serving replica drains (listed as draining to subscribers, stopped
with the drain grace, then killed and its placement freed); a freed slot of the pool's placement
group is reused. The real workers go through the same path in tests/e2e/test_autoscale_e2e.py."""

from __future__ import annotations

import os
import uuid

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config.duet import PoolSection
from cluster.deploy.controller import Controller
from cluster.deploy.pools import Replica, WorkerPool
from cluster.deploy.ray_actuator import RayActuator
from testkit.waiting import wait_until as _wait

NAMESPACE = "duet_ray_actuator_test"


@ray.remote
class DrainingFake:
    """The WorkerActor lifecycle; ``stop(grace)`` takes ``busy_s`` (in-flight requests finishing)."""

    def __init__(self) -> None:
        self.endpoint: str | None = None
        self.busy_s = 0.0
        self.stopped_with: float | None = None
        self.migrate_to: list | None = None

    async def start(self) -> str:
        self.endpoint = f"127.0.0.1:{10000 + os.getpid() % 50000}"
        return self.endpoint

    def info(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "incarnation": uuid.uuid4().hex if self.endpoint else None}

    def set_busy(self, seconds: float) -> None:
        self.busy_s = seconds

    def stop_grace(self) -> float | None:
        return self.stopped_with

    def stop_migrate_to(self) -> list | None:
        return self.migrate_to

    async def stop(self, grace: float = 0.0, migrate_to: list | None = None) -> None:
        import asyncio

        self.stopped_with, self.migrate_to = grace, migrate_to
        await asyncio.sleep(self.busy_s)
        self.endpoint = None


def _factory(worker_id: str, pg, first_bundle: int):
    return DrainingFake.options(
        name=worker_id, namespace=NAMESPACE, num_cpus=1, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle)).remote(), ()


@pytest.fixture
def scaled(ray_cluster):
    base = placement_group([{"CPU": 1}], name=f"{NAMESPACE}-base")
    ray.get(base.ready(), timeout=60)
    section = PoolSection(name="fake", replicas=1, cpus_per_replica=1)
    pool = WorkerPool(section, NAMESPACE, base, [Replica("fake", 0, "fake-0", _factory("fake-0", base, 0)[0], slot=0)],
                      make_actors=_factory)
    controller = Controller([pool], poll_interval_s=0.1)
    pushes: list = []  # appended on the controller thread, read whole by the test
    controller.start()
    assert controller.wait_ready(timeout=60)
    controller.subscribe(lambda details: pushes.append(list(details)), detailed=True)
    try:
        yield pool, controller, RayActuator([pool], controller, drain_grace_s=42.0, drain_settle_s=0.2), pushes
    finally:
        controller.stop()
        pool.shutdown(grace=0.0)


def test_scale_up_pending_drain_and_slot_reuse(scaled):
    pool, controller, actuator, pushes = scaled
    st = actuator.status("fake")
    assert (st.desired, st.ready, st.starting, st.pending, st.draining) == (1, 1, 0, 0, 0)

    actuator.scale_to("fake", 3)  # 1 CPU left: fake-1 fits in its own group, fake-2 finds no room
    _wait(lambda: actuator.status("fake").ready == 2, 60, "fake-1 up")
    st = actuator.status("fake")
    assert (st.desired, st.ready, st.starting, st.pending, st.capacity_replicas) == (3, 2, 0, 1, 2)
    pending_group = pool.replica("fake-2").own_placement_group
    assert placement_group_table(pending_group)["state"] == "PENDING"

    actuator.scale_to("fake", 2)  # the pending replica goes first, at once, with its group
    st = actuator.status("fake")
    assert (st.desired, st.ready, st.pending, st.draining) == (2, 2, 0, 0)
    assert [r.worker_id for r in pool.replicas] == ["fake-0", "fake-1"]
    assert placement_group_table(pending_group)["state"] == "REMOVED"

    fake1 = pool.replica("fake-1")
    ray.get(fake1.actor.set_busy.remote(1.0))  # its in-flight requests take 1 s to finish
    actuator.scale_to("fake", 1)  # the newest serving replica drains
    _wait(lambda: actuator.status("fake").draining == 1, 10, "fake-1 draining")
    assert actuator.status("fake").ready == 1 and [w for w, _ in controller.members()] == ["fake-0"]
    _wait(lambda: any(d[0] == "fake-1" and d[3:] == ("fake", True) for p in list(pushes) for d in p), 10,
          "a push listing fake-1 as draining")
    _wait(lambda: ray.get(fake1.actor.stop_grace.remote()) == 42.0, 10, "stop(drain grace) after the settle time")
    # its running requests migrate to the pool's other up replica (live migration) before it stops
    assert [w for w, _ in ray.get(fake1.actor.stop_migrate_to.remote())] == ["fake-0"]
    _wait(lambda: "fake-1" not in {r["worker_id"] for r in controller.describe()}, 30, "fake-1 released")
    assert controller.num_drained == 1 and placement_group_table(fake1.own_placement_group)["state"] == "REMOVED"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(fake1.actor.info.remote(), timeout=30)  # killed after draining
    _wait(lambda: all(d[0] != "fake-1" for d in pushes[-1]), 10, "fake-1 gone from the list")

    actuator.scale_to("fake", 0)  # fake-0 drains; its slot in the pool's group is freed ...
    # released: gone from the controller's list, then (pool.release, after killing it) its slot freed
    _wait(lambda: not controller.describe() and pool.free_slots == [0], 30, "fake-0 released")
    actuator.scale_to("fake", 1)  # ... and reused by the next replica, which needs no new group
    _wait(lambda: actuator.status("fake").ready == 1, 60, "fake-3 up")
    (replica,) = pool.replicas
    assert (replica.worker_id, replica.slot, replica.own_placement_group) == ("fake-3", 0, None)


def test_unknown_pool_and_bad_size(scaled):
    _, _, actuator, _ = scaled
    with pytest.raises(KeyError):
        actuator.status("nope")
    with pytest.raises(ValueError, match="must be >= 0"):
        actuator.scale_to("fake", -1)
