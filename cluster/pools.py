"""Worker pools: a pool's Ray actors, placed with one placement group, restarted by Ray.

Terms:
    replica     one WorkerActor (workers/actor.py): one engine behind the internal gRPC service.
    worker id   ``<pool>-<index>`` (``default-0``); also the actor's name in the Ray namespace
                (``ray.namespace``, default "duet"), which is how ``duet status`` finds it. It stays
                the same across Ray restarts; the endpoint does not.
    bundle      the placement group reserves one bundle ``{"CPU": cpus_per_replica}`` per replica;
                replica i always runs in bundle i, also after a restart.

Placement: the pool's placement group uses ``placement_strategy`` (SPREAD by default: replicas
on different nodes where possible, so a lost node costs one replica; PACK: fill a node first).
Reserving all bundles up front makes the pool all-or-nothing: either every replica has its CPUs
or ``create_pool`` fails (embedded Ray: at once, naming the shortfall; an existing cluster: after
``placement_timeout_s``, since an autoscaler may still be adding nodes).

Resizing at runtime (the autoscaler's Ray actuator, cluster/ray_actuator.py): ``add_replica``
creates replica ``<pool>-<next index>`` (indexes are never reused, so a name Ray is still
releasing never clashes) in a *slot* of the pool's placement group that an earlier removal freed,
else in a placement group of its own (one bundle per gang rank, PACK). That group may stay pending
when the cluster has no room: ``is_placed`` says so, and the replica is not capacity until it is.
``release`` kills a replica's actors and frees its slot or removes its own placement group; it is
the last step of a drain (cluster/controller.py), never the first.

Restarts: actors are created with ``max_restarts`` (default -1, forever). Ray restarts a dead
replica in its bundle and re-runs ``__init__``, but not ``start()``: the controller
(cluster/controller.py) notices and starts it again. The CPUs reserved per replica are also its
torch thread count (WorkerActor reads them from Ray).

Example::

    pool = create_pool(config.pool, config.to_engine_config(), namespace="duet")
    [r.worker_id for r in pool.replicas]         # ['default-0', 'default-1']
    endpoints = ray.get([r.actor.start.remote() for r in pool.replicas])
    pool.shutdown()                              # stop + kill the actors, remove the placement group
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.config import PoolSection

logger = logging.getLogger(__name__)


class PoolError(RuntimeError):
    """A pool could not be placed or created; the message names the setting to change."""


@dataclass(frozen=True)
class Replica:
    pool: str
    index: int
    worker_id: str
    actor: Any  # ray.actor.ActorHandle of workers.actor.WorkerActor (or a gang's GangLeaderActor)
    followers: tuple[Any, ...] = ()  # a gang's other ranks (GangFollowerActor handles), gang_size > 1
    own_placement_group: Any = None  # added at runtime with no free slot: its own group, removed with it
    slot: int | None = None  # else: its slot in the pool's placement group (bundles slot*W .. slot*W+W-1)


# Creates one replica's actors: (worker_id, placement group, first bundle index) -> (leader, followers).
ActorFactory = Callable[[str, Any, int], tuple[Any, tuple[Any, ...]]]


class WorkerPool:
    """A created pool: its replicas and placement group. Build with ``create_pool``.

    make_actors: how ``add_replica`` creates a replica's actors (``create_pool`` passes the real
    worker / gang factory; None = the pool cannot grow)."""

    def __init__(self, section: PoolSection, namespace: str, placement_group: Any, replicas: list[Replica],
                 make_actors: ActorFactory | None = None) -> None:
        self.section = section
        self.name = section.name
        self.namespace = namespace
        self.placement_group = placement_group
        self.replicas = replicas
        self._make_actors = make_actors
        self._lock = threading.Lock()
        self._next_index = max((r.index for r in replicas), default=-1) + 1
        self._free_slots: list[int] = []
        self._placed: set[str] = set()  # worker ids whose own placement group was seen CREATED
        self._shut_down = False

    def replica(self, worker_id: str) -> Replica:
        with self._lock:
            return next(r for r in self.replicas if r.worker_id == worker_id)

    def add_replica(self) -> Replica:
        """Create (not start) one more replica; see the module docstring for where it goes."""
        from ray.util.placement_group import placement_group, remove_placement_group

        assert self._make_actors is not None, f"pool {self.name!r} was built without an actor factory"
        ranks, cpus = self.section.gang_size, self.section.cpus_per_replica
        with self._lock:
            assert not self._shut_down, "add_replica after shutdown"
            index, self._next_index = self._next_index, self._next_index + 1
            slot = self._free_slots.pop(0) if self._free_slots else None
        worker_id = f"{self.name}-{index}"
        own = None
        if slot is None:
            own = placement_group([{"CPU": cpus} for _ in range(ranks)], strategy="PACK",
                                  name=f"duet-{self.namespace}-{worker_id}")
        try:
            actor, followers = self._make_actors(worker_id, own if own is not None else self.placement_group,
                                                 0 if slot is None else slot * ranks)
        except BaseException:
            if own is not None:
                remove_placement_group(own)
            else:
                with self._lock:
                    self._free_slots.append(slot)  # type: ignore[arg-type]
            raise
        replica = Replica(self.name, index, worker_id, actor, followers, own, slot)
        with self._lock:
            self.replicas.append(replica)
        where = f"slot {slot} of the pool's placement group" if own is None else "its own placement group"
        logger.info("pool %s: added replica %s in %s (%s)", self.name, worker_id, where,
                    "placed" if self.is_placed(replica) else "waiting for room in the cluster")
        return replica

    def is_placed(self, replica: Replica) -> bool:
        """Whether the replica's CPUs are reserved (False: pending, no room in the cluster yet)."""
        if replica.own_placement_group is None or replica.worker_id in self._placed:
            return True
        from ray.util import placement_group_table

        if placement_group_table(replica.own_placement_group).get("state") == "CREATED":
            self._placed.add(replica.worker_id)
            return True
        return False

    def release(self, replica: Replica) -> None:
        """Kill the replica's actors (no restart) and free its slot or remove its placement group.
        The caller drained it first (cluster/controller.py). Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            if replica not in self.replicas:
                return
            self.replicas.remove(replica)
        for actor in (replica.actor, *replica.followers):
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone is fine
                logger.debug("pool %s: kill %s: %r", self.name, replica.worker_id, e)
        if replica.own_placement_group is not None:
            remove_placement_group(replica.own_placement_group)
        elif replica.slot is not None:
            with self._lock:
                self._free_slots.append(replica.slot)
        self._placed.discard(replica.worker_id)
        logger.info("pool %s: replica %s removed", self.name, replica.worker_id)

    def shutdown(self, grace: float = 5.0, timeout: float = 30.0) -> None:
        """Stop each replica (drain for ``grace`` s, abort the rest), kill the actors without restart,
        remove the placement group. Idempotent; dead or restarting actors are simply killed."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            replicas = list(self.replicas)
        import ray
        from ray.util.placement_group import remove_placement_group

        refs = [r.actor.stop.remote(grace) for r in replicas]
        _, not_done = ray.wait(refs, num_returns=len(refs), timeout=grace + timeout)
        if not_done:
            logger.warning("pool %s: %d replicas did not stop within %.0f s; killing them",
                           self.name, len(not_done), grace + timeout)
        for actor in [a for r in replicas for a in (r.actor, *r.followers)]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone is fine; anything else is worth a line
                logger.debug("pool %s: kill %s: %r", self.name, actor, e)
        for pg in [self.placement_group, *(r.own_placement_group for r in replicas)]:
            if pg is not None:
                remove_placement_group(pg)
        logger.info("pool %s: %d replicas stopped, placement groups removed", self.name, len(replicas))


def create_pool(section: PoolSection, engine_config: Any, namespace: str, *, embedded: bool = True,
                placement_timeout_s: float = 60.0, host: str | None = None) -> WorkerPool:
    """Reserve the pool's placement group and create (not start) its replicas.

    engine_config: the workers.config.EngineConfig every replica runs. host: address the workers
    bind and advertise (default: each node's IP). embedded: the Ray cluster cannot grow, so a
    shortfall of CPUs fails at once instead of after ``placement_timeout_s``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    cpus = section.cpus_per_replica
    ranks = section.gang_size  # bundles per replica: one per rank of its gang
    needed = section.replicas * ranks * cpus
    have = ray.cluster_resources().get("CPU", 0)
    if embedded and needed > have:
        raise PoolError(
            f"pool {section.name!r} needs {section.replicas} replicas x {ranks} ranks (ep_size x sp_size x tp_size) x {cpus} CPUs = "
            f"{needed} CPUs, but the embedded Ray has {have:g}; lower the pool's replicas / ep_size / tp_size / sp_size / "
            "cpus_per_replica or raise ray.num_cpus")
    pg = placement_group([{"CPU": cpus} for _ in range(section.replicas * ranks)], strategy=section.placement_strategy,
                         name=f"duet-{namespace}-{section.name}")
    replicas: list[Replica] = []
    make_actors = _actor_factory(section, engine_config, namespace, host)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=placement_timeout_s)
        if not ready:
            raise PoolError(
                f"pool {section.name!r}: could not reserve {section.replicas} bundles of {cpus} CPUs "
                f"({section.placement_strategy}) within {placement_timeout_s:.0f} s; the cluster has "
                f"{ray.available_resources().get('CPU', 0):g} CPUs free of {ray.cluster_resources().get('CPU', 0):g}. "
                "Lower the pool's replicas / cpus_per_replica, add nodes, or relax placement_strategy")
        for i in range(section.replicas):
            worker_id = f"{section.name}-{i}"
            actor, followers = make_actors(worker_id, pg, i * ranks)
            replicas.append(Replica(section.name, i, worker_id, actor, followers, slot=i))
    except BaseException:
        for actor in [a for r in replicas for a in (r.actor, *r.followers)]:
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
        raise
    logger.info("pool %s: %d replicas x %d CPU (%s) created in namespace %r", section.name, section.replicas, cpus,
                section.placement_strategy, namespace)
    return WorkerPool(section, namespace, pg, replicas, make_actors)


def _actor_factory(section: PoolSection, engine_config: Any, namespace: str, host: str | None) -> ActorFactory:
    """The pool's ActorFactory: a WorkerActor, or a gang, named ``worker_id``, from bundle ``first_bundle``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.actor import WorkerActor

    def make(worker_id: str, pg: Any, first_bundle: int) -> tuple[Any, tuple[Any, ...]]:
        options = dict(
            name=worker_id, namespace=namespace, num_cpus=section.cpus_per_replica, max_restarts=section.max_restarts,
            max_task_retries=0,  # a call lost with its process is reported, never silently re-run
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle))
        try:
            if section.gang_size == 1:
                return WorkerActor.options(**options).remote(engine_config, worker_id, host), ()
            return _create_gang(section, engine_config, host, pg, first_bundle, options)
        except ValueError as e:  # the name is taken
            raise PoolError(
                f"pool {section.name!r}: actor {worker_id!r} already exists in Ray namespace {namespace!r} "
                f"({e}); another `duet serve` is using this Ray cluster: stop it, or give this one "
                "another ray.namespace or pool name") from None

    return make


def _create_gang(section: PoolSection, engine_config: Any, host: str | None, pg: Any, first_bundle: int,
                 leader_options: dict) -> tuple[Any, tuple[Any, ...]]:
    """A replica as a gang (expert / sequence / tensor parallel): followers in bundles first_bundle+1.., the leader
    (named like a plain worker) in bundle first_bundle. See workers/parallel/gang_actor.py."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.parallel.eplb import RebalanceConfig
    from workers.parallel.gang_actor import GangFollowerActor, GangLeaderActor
    from workers.parallel.groups import ParallelConfig

    ranks = section.gang_size
    parallel = ParallelConfig(ep_size=section.ep_size, sp_size=section.sp_size, tp_size=section.tp_size)
    followers = tuple(
        GangFollowerActor.options(
            num_cpus=section.cpus_per_replica, max_restarts=section.max_restarts, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + r),
        ).remote(engine_config, parallel, r)
        for r in range(1, ranks)
    )
    try:
        leader = GangLeaderActor.options(**leader_options).remote(
            engine_config, leader_options["name"], host, parallel, list(followers), RebalanceConfig())
    except BaseException:
        for f in followers:
            ray.kill(f, no_restart=True)
        raise
    return leader, followers
