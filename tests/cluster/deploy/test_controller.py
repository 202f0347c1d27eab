"""The controller's membership state machine on the session's Ray cluster, with tiny fake worker
actors (no torch, no model): joins are pushed, a Ray restart is noticed, started again and pushed
as a leave + join with the new endpoint, and a worker whose start() raises is reported, not retried.
The real workers go through the same path in tests/e2e/test_serving_e2e.py."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import ray

from cluster.config.duet import PoolSection
from cluster.deploy.controller import Controller
from cluster.deploy.pools import Replica, WorkerPool


@ray.remote(num_cpus=0)
class FakeWorker:
    """Speaks the WorkerActor lifecycle (start / info / stop); the endpoint is fake but unique per
    process, like a real restart's new port."""

    def __init__(self, fail_start: bool = False, stopped_marker: str = "") -> None:
        self.fail_start, self.stopped_marker = fail_start, stopped_marker
        self.endpoint: str | None = None
        self.incarnation: str | None = None

    async def start(self) -> str:
        if self.fail_start:
            raise RuntimeError("model 'nope' not found")
        self.endpoint, self.incarnation = f"127.0.0.1:{10000 + os.getpid() % 50000}", uuid.uuid4().hex
        return self.endpoint

    def info(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "incarnation": self.incarnation, "pid": os.getpid()}

    async def stop(self, grace: float = 0.0, migrate_to: list | None = None) -> None:
        self.endpoint = None
        if self.stopped_marker:  # survives the kill that follows a pool's shutdown
            open(self.stopped_marker, "w").close()


def _pool(name: str, *fail: bool, markers: Path | None = None) -> WorkerPool:
    replicas = [Replica(name, i, f"{name}-{i}", FakeWorker.options(max_restarts=-1).remote(
                    f, str(markers / f"{name}-{i}") if markers else "")) for i, f in enumerate(fail)]
    return WorkerPool(PoolSection(name=name, replicas=len(fail)), "test", None, replicas)


def test_joins_restart_and_leave_are_pushed(ray_cluster):
    pool = _pool("fake", False, False)
    pushes: list[list[tuple[str, str]]] = []
    lock = threading.Lock()

    def record(members):
        with lock:
            pushes.append(list(members))

    controller = Controller([pool], poll_interval_s=0.1)
    try:
        controller.start()
        assert controller.wait_ready(timeout=60)
        controller.subscribe(record)
        first = dict(controller.members())
        assert sorted(first) == ["fake-0", "fake-1"] and pushes == [sorted(first.items())]

        victim = pool.replica("fake-0").actor
        ray.kill(victim, no_restart=False)  # Ray restarts it: __init__ again, not start()
        assert controller.wait_for(lambda m: dict(m).get("fake-0") not in (None, first["fake-0"]), timeout=60)
        deadline = time.monotonic() + 10  # the push follows the state change on the next poll
        while len(pushes[-1]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with lock:
            seen = [dict(p) for p in pushes]
        assert {"fake-1": first["fake-1"]} in seen  # the leave was pushed before the join
        assert seen[-1]["fake-0"] != first["fake-0"] and seen[-1]["fake-1"] == first["fake-1"]
        assert controller.num_restarts == 1
        states = {r["worker_id"]: r for r in controller.describe()}
        assert states["fake-0"]["state"] == "up" and states["fake-0"]["starts"] == 2
    finally:
        controller.stop()
        for r in pool.replicas:
            ray.kill(r.actor, no_restart=True)


def test_failed_start_is_reported_not_retried(ray_cluster):
    pool = _pool("broken", False, True)
    controller = Controller([pool], poll_interval_s=0.1)
    try:
        controller.start()
        assert not controller.wait_ready(timeout=60)  # returns as soon as broken-1 failed, not at the timeout
        assert controller.wait_ready(1, timeout=60)
        states = {r["worker_id"]: r for r in controller.describe()}
        assert states["broken-1"]["state"] == "failed" and "model 'nope' not found" in states["broken-1"]["last_error"]
        assert states["broken-1"]["starts"] == 1
        assert [w for w, _ in controller.members()] == ["broken-0"]
    finally:
        controller.stop()
        for r in pool.replicas:
            ray.kill(r.actor, no_restart=True)


def test_a_gang_rendezvous_timeout_is_retried_other_start_errors_are_not():
    """A gang leader's start that timed out waiting for its ranks (a rank Ray restarted on a healed
    node is still loading) leaves the replica 'down', so the next probe starts it again; any other
    error from start() (a bad model, a taken port) is 'failed', not retried (test above)."""
    import torch.distributed as dist

    from cluster.deploy.controller import _rendezvous_timeout

    class _TaskError(Exception):  # what ray.exceptions.RayTaskError exposes: the remote exception as .cause
        def __init__(self, cause: Exception) -> None:
            super().__init__(str(cause))
            self.cause = cause

    timeout = dist.DistStoreError("Timed out after 31 seconds waiting for clients. 1/2 clients joined.")
    assert _rendezvous_timeout(_TaskError(timeout))
    assert not _rendezvous_timeout(_TaskError(FileNotFoundError("model 'nope' not found")))
    assert not _rendezvous_timeout(_TaskError(OSError("address already in use")))


def test_shutdown_stops_the_replicas_the_controller_saw_running(ray_cluster, tmp_path):
    """A deployment's teardown asks the controller which replicas run (``running()``: up, standby or
    draining) instead of looking each one's placement up in Ray's GCS (under a process-group SIGTERM
    the GCS stops under that call and Ray aborts the process): those are stopped, the others (here
    one whose start failed) only killed."""
    pool = _pool("mixed", False, True, markers=tmp_path)
    controller = Controller([pool], poll_interval_s=0.1)
    try:
        controller.start()
        assert not controller.wait_ready(timeout=60) and controller.wait_ready(1, timeout=60)
        assert controller.running() == {"mixed-0"}
    finally:
        controller.stop()
    actors = [r.actor for r in pool.replicas]
    pool.shutdown(grace=0, running=controller.running())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed-0"]  # mixed-1 was not asked to stop
    for actor in actors:  # both killed, not restarted
        try:
            ray.get(actor.info.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            continue
        raise AssertionError(f"{actor} still answers after the pool's shutdown")
