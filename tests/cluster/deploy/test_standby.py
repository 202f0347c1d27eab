"""Standby replicas through the real controller, pool and Ray actuator on the session's Ray cluster
(2 CPUs), with tiny fake worker actors (no model; the real worker's prepare / start path is in
tests/e2e/test_coldstart_e2e.py): the controller keeps the standby count, a standby is no member,
a scale-up promotes it (it joins, and a replacement is loaded), a standby that dies is replaced,
the pool's states are reported (``pool_states``, /metrics), and a pool scaled to zero is woken by
``PoolWaker`` from its standby."""

from __future__ import annotations

import os
import uuid

import pytest
import ray
from prometheus_client import CollectorRegistry, generate_latest
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config.duet import PoolSection
from cluster.deploy.controller import Controller
from cluster.deploy.pool_metrics import PoolStateCollector
from cluster.deploy.pools import Replica, WorkerPool
from cluster.deploy.ray_actuator import RayActuator
from cluster.deploy.wake import PoolWaker
from testkit.waiting import wait_until

NAMESPACE = "duet_standby_test"


@ray.remote
class StandbyFake:
    """The WorkerActor lifecycle with prepare(): loaded but not serving, until start()."""

    def __init__(self) -> None:
        self.endpoint: str | None = None
        self.prepared = False
        self.load: str | None = None

    async def prepare(self, load: str = "model") -> None:
        self.prepared, self.load = True, load

    def prepared_load(self) -> str | None:
        """What the controller asked prepare() for (the pool's standby_load)."""
        return self.load

    async def start(self) -> str:
        self.endpoint = f"127.0.0.1:{10000 + os.getpid() % 50000}"
        return self.endpoint

    def info(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "incarnation": uuid.uuid4().hex if self.endpoint else None,
                "standby": self.prepared and self.endpoint is None, "pid": os.getpid()}

    async def stop(self, grace: float = 0.0, migrate_to: list | None = None) -> None:
        self.endpoint = None


def _factory(worker_id: str, pg, first_bundle: int):
    return StandbyFake.options(
        name=worker_id, namespace=NAMESPACE, num_cpus=1, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle)).remote(), ()


@pytest.fixture(params=["model"])
def pool_and_controller(ray_cluster, request):
    base = placement_group([{"CPU": 1}], name=f"{NAMESPACE}-base")
    ray.get(base.ready(), timeout=60)
    section = PoolSection(name="fake", replicas=1, cpus_per_replica=1, standby_load=request.param)
    pool = WorkerPool(section, NAMESPACE, base,
                      [Replica("fake", 0, "fake-0", _factory("fake-0", base, 0)[0], slot=0)], make_actors=_factory)
    controller = Controller([pool], poll_interval_s=0.1)
    controller.start()
    assert controller.wait_ready(timeout=60)
    try:
        yield pool, controller
    finally:
        controller.stop()
        pool.shutdown(grace=0)


def _states(controller: Controller) -> dict[str, str]:
    return {r["worker_id"]: ("standby:" if r["standby"] else "") + str(r["state"]) for r in controller.describe()}


def test_standby_is_kept_promoted_replaced_and_reported(pool_and_controller):
    pool, controller = pool_and_controller
    actuator = RayActuator([pool], controller, drain_grace_s=1.0, drain_settle_s=0.1)
    actuator.set_standby("fake", 1)
    wait_until(lambda: _states(controller).get("fake-1") == "standby:standby", 60, "fake-1 loaded as a standby")
    assert [w for w, _ in controller.members()] == ["fake-0"]  # a standby is not routed to
    st = actuator.status("fake")
    assert (st.ready, st.standby, st.standby_target) == (1, 1, 1)

    registry = CollectorRegistry()
    registry.register(PoolStateCollector(controller))
    text = generate_latest(registry).decode()
    assert 'duet_pool_replicas{pool="fake",state="standby"} 1.0' in text
    assert 'duet_pool_standby_target{pool="fake"} 1.0' in text

    actuator.scale_to("fake", 2)  # promotes the standby instead of creating a replica
    wait_until(lambda: [w for w, _ in controller.members()] == ["fake-0", "fake-1"], 60, "the promoted standby to join")
    assert controller.num_promoted == 1 and [how for _, how, _ in controller.joins][-1] == "promoted"
    # its replacement waits for room (2 CPUs, both serving): a standby being loaded, not capacity
    wait_until(lambda: _states(controller).get("fake-2") == "standby:preparing", 30, "a replacement standby")
    assert actuator.status("fake").ready == 2

    actuator.scale_to("fake", 1)  # fake-1 drains and is released: its CPU goes to the replacement
    wait_until(lambda: _states(controller).get("fake-2") == "standby:standby", 60, "the replacement to load")

    ray.kill(pool.replica("fake-2").actor, no_restart=True)  # a standby that dies is replaced
    wait_until(lambda: controller.num_standby_replaced == 1 and "standby:standby" in _states(controller).values()
               and "fake-2" not in _states(controller), 60, "the dead standby to be replaced")
    assert [w for w, _ in controller.members()] == ["fake-0"]


def test_a_pool_at_zero_wakes_from_its_standby(pool_and_controller):
    pool, controller = pool_and_controller
    actuator = RayActuator([pool], controller, drain_grace_s=1.0, drain_settle_s=0.1)
    actuator.set_standby("fake", 1)
    wait_until(lambda: "standby:standby" in _states(controller).values(), 60, "a standby")
    actuator.scale_to("fake", 0)  # the autoscaler scaled the idle pool to zero
    wait_until(lambda: controller.members() == [], 60, "the pool at zero")
    waker = PoolWaker(actuator, {"fake": "colocated"})
    assert waker.wake(["prefill"]).woken == ()  # not a role this pool has
    out = waker.wake(["colocated", "decode"], "test router")
    assert out.woken == ("fake",) and out.from_standby == ("fake",)
    assert waker.wake(["colocated"]).waking in ((), ("fake",))  # already waking (or already up)
    wait_until(lambda: len(controller.members()) == 1, 60, "the woken replica to join")
    assert [how for _, how, _ in controller.joins][-1] == "promoted"
    assert waker.wake(["colocated"]) == type(out)()  # serving: nothing to do


@pytest.mark.parametrize("pool_and_controller", ["process"], indirect=True)
def test_a_warm_process_standby_is_prepared_as_one_and_promoted(pool_and_controller):
    """standby_load: process reaches the actor's prepare() (the warm process itself: tests/workers/
    server/test_warm_process.py); the standby lifecycle around it is the same."""
    pool, controller = pool_and_controller
    actuator = RayActuator([pool], controller, drain_grace_s=1.0, drain_settle_s=0.1)
    actuator.set_standby("fake", 1)
    wait_until(lambda: _states(controller).get("fake-1") == "standby:standby", 60, "fake-1 prepared as a standby")
    assert ray.get(pool.replica("fake-1").actor.prepared_load.remote(), timeout=30) == "process"
    assert ray.get(pool.replica("fake-0").actor.prepared_load.remote(), timeout=30) is None  # serving, never prepared
    actuator.scale_to("fake", 2)
    wait_until(lambda: [w for w, _ in controller.members()] == ["fake-0", "fake-1"], 60, "the promoted warm process")
    assert [how for _, how, _ in controller.joins][-1] == "promoted"


def test_duet_status_lists_standby_replicas():
    from cluster.deploy.status import format_status

    text = format_status({"router": None, "workers": [
        {"pool": "default", "worker_id": "default-0", "endpoint": None, "error": "not serving (starting)"},
        {"pool": "default", "worker_id": "default-2", "endpoint": None, "pid": 9, "standby": True,
         "node_id": "5c1a09e2aaaa"}]})
    assert "pool default: 1 workers, 1 standby" in text
    assert "default-2    -                      STANDBY     loaded, unrouted (promoted first on a scale-up)  pid 9  " \
           "node 5c1a09e2" in text
