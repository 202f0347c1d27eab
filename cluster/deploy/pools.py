"""Worker pools: a pool's Ray actors, placed with one placement group, restarted by Ray.

Terms:
    replica     one WorkerActor (workers/server/actor.py): one engine behind the internal gRPC service;
                in a ``role: drafter`` pool, one DrafterActor (workers/spec_decode/drafter_actor.py): a
                draft engine behind the Drafter service, with the same start / info / stop lifecycle.
    worker id   ``<pool>-<index>`` (``default-0``); also the actor's name in the Ray namespace
                (``ray.namespace``, default "duet"), which is how ``duet status`` finds it. It stays
                the same across Ray restarts; the endpoint does not.
    bundle      the placement group reserves one bundle per rank (``rank_bundle``: ``{"CPU":
                cpus_per_replica}`` plus ``gpus_per_rank`` GPUs and ``resources_per_rank``); replica
                i's ranks always run in bundles i*gang_size.., also after a restart.

Placement: the pool's placement group uses ``placement_strategy`` (SPREAD by default: replicas
on different nodes where possible, so a lost node costs one replica; PACK: fill a node first).
Reserving all bundles up front makes the pool all-or-nothing: either every replica has its resources
or ``create_pool`` fails (embedded Ray: at once, naming the shortfall; an existing cluster: after
``placement_timeout_s``, since an autoscaler may still be adding nodes).

Resizing at runtime (the autoscaler's Ray actuator, cluster/deploy/ray_actuator.py): ``add_replica``
creates replica ``<pool>-<next index>`` (indexes are never reused, so a name Ray is still
releasing never clashes) in a *slot* of the pool's placement group that an earlier removal freed,
else in a placement group of its own (one bundle per gang rank, PACK). That group may stay pending
when the cluster has no room: ``is_placed`` says so, and the replica is not capacity until it is.
``release`` kills a replica's actors and frees its slot or removes its own placement group; it is
the last step of a drain (cluster/deploy/controller.py), never the first.

Restarts: actors are created with ``max_restarts`` (default -1, forever). Ray restarts a dead
replica in its bundle and re-runs ``__init__``, but not ``start()``: the controller
(cluster/deploy/controller.py) notices and starts it again. The CPUs reserved per replica are also its
torch thread count (WorkerActor reads them from Ray).

Controller restarts (an existing cluster only: ``embedded=False``): the actors and placement groups
are created *detached*, so they outlive the ``duet serve`` that made them, and every replica is
recorded in Ray (cluster/deploy/registry.py: its slot or own placement group, its gang followers'
names). ``create_pool`` with recorded replicas of the pool *adopts* them: it finds the placement
group and the actors by name and creates only the ones that are gone (in their recorded bundles);
the controller's ``start()`` is idempotent, so an adopted worker that serves answers with its
endpoint at once (no reload, its KV cache intact) and one that Ray restarted meanwhile loads again.
A standby replica is recorded as one (``add_replica(standby=True)``, until ``mark_serving``) and
adopted as one (``is_standby``): the controller prepares it again (idempotent) and keeps it unrouted
until it is promoted, as before the restart. A draining replica is recorded with the end of its drain
(``mark_draining``) and adopted still draining (``drain_until``): the controller stops and releases
it once that time has passed, as the dead controller would have.

Example::

    pool = create_pool(config.pool, config.to_engine_config(), namespace="duet")
    [r.worker_id for r in pool.replicas]         # ['default-0', 'default-1']
    endpoints = ray.get([r.actor.start.remote() for r in pool.replicas])
    pool.shutdown()                              # stop + kill the actors, remove the placement group
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from cluster.config.duet import PoolSection
from cluster.deploy.registry import Registry, ReplicaRecord

logger = logging.getLogger(__name__)


class PoolError(RuntimeError):
    """A pool could not be placed or created; the message names the setting to change."""


@dataclass(frozen=True)
class Replica:
    pool: str
    index: int
    worker_id: str
    actor: Any  # ray.actor.ActorHandle of workers.server.actor.WorkerActor (or a gang's GangLeaderActor)
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
                 make_actors: ActorFactory | None = None, registry: Registry | None = None,
                 free_slots: list[int] | None = None, standby: frozenset[str] = frozenset(),
                 draining: dict[str, float] | None = None) -> None:
        self.section = section
        self.name = section.name
        self.namespace = namespace
        self.placement_group = placement_group
        self.replicas = replicas
        self._make_actors = make_actors
        self._lock = threading.Lock()
        self._next_index = max((r.index for r in replicas), default=-1) + 1
        self._free_slots: list[int] = list(free_slots or [])
        self._shut_down = False
        self._registry = registry  # records each replica for a restarted controller (None: embedded Ray)
        self._standby = set(standby)  # worker ids of standby replicas (adopted as such, or added so)
        self._draining = dict(draining or {})  # worker id -> wall-clock end of its drain's grace
        for r in replicas:
            self._record(r)

    def replica(self, worker_id: str) -> Replica:
        with self._lock:
            return next(r for r in self.replicas if r.worker_id == worker_id)

    @property
    def free_slots(self) -> list[int]:
        """Slots of the pool's placement group that no replica holds now (the next ``add_replica``
        takes the first; it creates its own group only when this is empty)."""
        with self._lock:
            return list(self._free_slots)

    def is_standby(self, worker_id: str) -> bool:
        """Whether the replica is a standby one: added with ``standby`` or adopted as one, not promoted since."""
        with self._lock:
            return worker_id in self._standby

    def mark_serving(self, replica: Replica) -> None:
        """A standby replica was promoted: record it as serving (a restarted controller starts it)."""
        with self._lock:
            if replica.worker_id not in self._standby:
                return
            self._standby.discard(replica.worker_id)
        self._record(replica)

    def drain_until(self, worker_id: str) -> float | None:
        """When the replica's drain ends (wall clock), if it is draining (``mark_draining``, or adopted so)."""
        with self._lock:
            return self._draining.get(worker_id)

    def mark_draining(self, replica: Replica, until: float) -> None:
        """The controller is draining the replica until ``until`` (wall clock): record it, so a
        restarted controller finishes the drain instead of serving from it again."""
        with self._lock:
            self._draining[replica.worker_id] = until
        self._record(replica)

    def add_replica(self, *, standby: bool = False) -> Replica:
        """Create (not start) one more replica; see the module docstring for where it goes.
        standby: it is to be loaded as a standby replica (and recorded so)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        assert self._make_actors is not None, f"pool {self.name!r} was built without an actor factory"
        ranks = self.section.gang_size
        with self._lock:
            assert not self._shut_down, "add_replica after shutdown"
            index, self._next_index = self._next_index, self._next_index + 1
            slot = self._free_slots.pop(0) if self._free_slots else None
        worker_id = f"{self.name}-{index}"
        own = None
        if slot is None:
            own = placement_group([rank_bundle(self.section) for _ in range(ranks)], strategy="PACK",
                                  name=f"duet-{self.namespace}-{worker_id}",
                                  lifetime="detached" if self._registry is not None else None)
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
            if standby:
                self._standby.add(worker_id)
        self._record(replica)
        where = f"slot {slot} of the pool's placement group" if own is None else "its own placement group"
        logger.info("pool %s: added replica %s in %s (%s)", self.name, worker_id, where,
                    "placed" if self.is_placed(replica) else "waiting for room in the cluster")
        return replica

    def _record(self, r: Replica) -> None:
        if self._registry is None:
            return
        import ray

        own = r.own_placement_group
        own_name = None
        if own is not None:
            own_name = ray.util.placement_group_table(own).get("name") or f"duet-{self.namespace}-{r.worker_id}"
        followers = tuple(_follower_name(r.worker_id, rank) for rank in range(1, len(r.followers) + 1))
        self._registry.record(ReplicaRecord(self.name, r.index, r.worker_id, r.slot, own_name, followers,
                                            standby=self.is_standby(r.worker_id),
                                            drain_until=self.drain_until(r.worker_id)))

    def is_placed(self, replica: Replica) -> bool:
        """Whether every bundle of the replica is reserved on a node that is alive now. False: its
        own group waits for room in the cluster, or its node died and Ray is re-placing its bundles
        (a placement group RESCHEDULING until a node with room joins): not capacity either way."""
        import ray

        nodes = self.bundle_nodes(replica)
        if not all(nodes):
            return False
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return all(n in alive for n in nodes)

    def bundle_nodes(self, replica: Replica) -> list[str]:
        """The Ray node id holding each of the replica's bundles, in rank order ("" for a bundle
        not placed now)."""
        from ray.util import placement_group_table

        own = replica.own_placement_group
        first = 0 if own is not None else replica.slot * self.section.gang_size  # type: ignore[operator]
        where = placement_group_table(own if own is not None else self.placement_group).get("bundles_to_node_id", {})
        return [where.get(first + rank, "") for rank in range(self.section.gang_size)]

    def release(self, replica: Replica) -> None:
        """Kill the replica's actors (no restart) and free its slot or remove its placement group.
        The caller drained it first (cluster/deploy/controller.py). Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            if replica not in self.replicas:
                return
            self.replicas.remove(replica)
            self._standby.discard(replica.worker_id)
            self._draining.pop(replica.worker_id, None)
        if self._registry is not None:
            self._registry.forget(replica.worker_id)
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
        logger.info("pool %s: replica %s removed", self.name, replica.worker_id)

    def shutdown(self, grace: float = 5.0, timeout: float = 30.0, *, running: Collection[str] | None = None) -> None:
        """Stop each replica (drain for ``grace`` s, abort the rest), kill the actors without restart,
        remove the placement group. Idempotent; dead or restarting actors are simply killed, and so is
        a replica whose own group still waits for room (it never ran: nothing to drain).

        running: the worker ids known to run (``Controller.running()``): only they are asked to stop,
        the rest are killed. Without it each replica's placement is looked up in Ray's GCS -- which a
        deployment's teardown avoids: a SIGTERM to the whole process group stops the embedded GCS under
        that lookup, and Ray aborts the process when a GCS state call is cancelled."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            replicas = list(self.replicas)
        import ray
        from ray.util.placement_group import remove_placement_group

        # a replica whose group still waits for room never ran: no stop() to wait for (it would
        # never return), it is only killed with its group
        refs = [r.actor.stop.remote(grace) for r in replicas
                if (r.worker_id in running if running is not None else self.is_placed(r))]
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
        if self._registry is not None:
            for r in replicas:
                self._registry.forget(r.worker_id)
        logger.info("pool %s: %d replicas stopped, placement groups removed", self.name, len(replicas))


def create_pool(section: PoolSection, engine_config: Any, namespace: str, *, embedded: bool = True,
                placement_timeout_s: float = 60.0, host: str | None = None,
                registry: Registry | None = None) -> WorkerPool:
    """Reserve the pool's placement group and create (not start) its replicas.

    engine_config: the workers.config.EngineConfig every replica runs (a drafter pool's: its draft
    model's, ``DuetConfig.to_drafter_engine_config``). host: address the workers bind and advertise
    (default: each node's IP). embedded: the Ray cluster cannot grow, so a
    shortfall of CPUs fails at once instead of after ``placement_timeout_s``. registry (an existing
    cluster): actors and placement groups are detached and recorded there, and recorded replicas of
    this pool are adopted (module docstring).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if registry is not None and (records := registry.records(section.name)):
        return _adopt(section, engine_config, namespace, host, registry, records)

    cpus = section.cpus_per_replica
    ranks = section.gang_size  # bundles per replica: one per rank of its gang
    bundle = rank_bundle(section)
    if embedded:
        _check_embedded_capacity(section, bundle, ray.cluster_resources())
        _check_embedded_drafters(section, ray.cluster_resources())
    pg = placement_group([dict(bundle) for _ in range(section.replicas * ranks)], strategy=section.placement_strategy,
                         name=f"duet-{namespace}-{section.name}", lifetime="detached" if registry is not None else None)
    replicas: list[Replica] = []
    make_actors = _actor_factory(section, engine_config, namespace, host, detached=registry is not None)
    try:
        shortfall = None if embedded else strict_shortfall(section, bundle, ray.nodes())
        if shortfall:
            logger.warning("%s; waiting up to %.0f s for nodes to join", shortfall, placement_timeout_s)
        ready, _ = ray.wait([pg.ready()], timeout=placement_timeout_s)
        if not ready and (shortfall := None if embedded else strict_shortfall(section, bundle, ray.nodes())):
            raise PoolError(f"{shortfall} (waited {placement_timeout_s:.0f} s: controller.placement_timeout_s)")
        if not ready:
            free, total = ray.available_resources(), ray.cluster_resources()
            have = ", ".join(f"{free.get(k, 0):g} {k} free of {total.get(k, 0):g}" for k in bundle)
            raise PoolError(
                f"pool {section.name!r}: could not reserve {section.replicas} replicas x {ranks} ranks = "
                f"{section.replicas * ranks} bundles of {_shape(bundle)} ({section.placement_strategy}) within "
                f"{placement_timeout_s:.0f} s; the cluster has {have}. Lower the pool's replicas / cpus_per_replica "
                "/ gpus_per_rank, add nodes that offer these resources, or relax placement_strategy")
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
    return WorkerPool(section, namespace, pg, replicas, make_actors, registry)


def _adopt(section: PoolSection, engine_config: Any, namespace: str, host: str | None, registry: Registry,
           records: list[ReplicaRecord]) -> WorkerPool:
    """A restarted controller's pool: the recorded replicas whose bundles still exist, their actors
    found by name (or created again in those bundles when Ray lost them); the pool's unused slots
    become free ones. Replicas whose own placement group is gone are forgotten (the autoscaler or
    the configured size brings the pool back up)."""
    import ray
    from ray.util import get_placement_group

    ranks = section.gang_size
    make_actors = _actor_factory(section, engine_config, namespace, host, detached=True)

    def find_pg(name: str) -> Any:
        try:
            return get_placement_group(name)
        except ValueError:
            return None

    def find_actor(name: str) -> Any:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            return None

    pg = find_pg(f"duet-{namespace}-{section.name}")
    slots = len(ray.util.placement_group_table(pg).get("bundles", {})) // ranks if pg is not None else 0
    replicas: list[Replica] = []
    recreated = 0
    for rec in records:
        own = find_pg(rec.own_placement_group) if rec.own_placement_group else None
        where, first = (own, 0) if own is not None else (pg, (rec.slot or 0) * ranks)
        if where is None or (own is None and (rec.slot is None or rec.slot >= slots)):
            logger.warning("pool %s: recorded replica %s has no placement left; forgetting it", section.name,
                           rec.worker_id)
            registry.forget(rec.worker_id)
            continue
        actor, followers = find_actor(rec.worker_id), tuple(find_actor(n) for n in rec.followers)
        if actor is None or any(f is None for f in followers):
            for a in (actor, *followers):
                if a is not None:
                    ray.kill(a, no_restart=True)
            actor, followers = make_actors(rec.worker_id, where, first)
            recreated += 1
        replicas.append(Replica(section.name, rec.index, rec.worker_id, actor, followers, own,
                                None if own is not None else rec.slot))
    if pg is None:  # the pool's own group is gone: later replicas get groups of their own
        logger.warning("pool %s: its placement group is gone; adopted only replicas with their own", section.name)
    used = {r.slot for r in replicas if r.slot is not None}
    logger.info("pool %s: adopted %d recorded replicas (%d created again: their actors were gone; %d standby) in "
                "namespace %r", section.name, len(replicas), recreated,
                sum(rec.standby for rec in records if any(r.worker_id == rec.worker_id for r in replicas)), namespace)
    adopted = {r.worker_id for r in replicas}
    return WorkerPool(section, namespace, pg, replicas, make_actors, registry,
                      free_slots=[s for s in range(slots) if s not in used],
                      standby=frozenset(rec.worker_id for rec in records if rec.standby and rec.worker_id in adopted),
                      draining={rec.worker_id: rec.drain_until for rec in records
                                if rec.drain_until is not None and rec.worker_id in adopted})


def _follower_name(worker_id: str, rank: int) -> str:
    return f"{worker_id}.rank{rank}"


def _actor_factory(section: PoolSection, engine_config: Any, namespace: str, host: str | None,
                   detached: bool = False) -> ActorFactory:
    """The pool's ActorFactory: a WorkerActor, or a gang, named ``worker_id``, from bundle ``first_bundle``.
    detached: the actors outlive this process (an existing cluster: module docstring)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.server.actor import WorkerActor

    lifetime = {"lifetime": "detached"} if detached else {}

    def make(worker_id: str, pg: Any, first_bundle: int) -> tuple[Any, tuple[Any, ...]]:
        options = dict(
            name=worker_id, namespace=namespace, **rank_actor_options(section, engine_config),
            max_restarts=section.max_restarts, **lifetime,
            max_task_retries=0,  # a call lost with its process is reported, never silently re-run
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle))
        try:
            if section.role == "drafter":
                return _create_drafter(section, engine_config, worker_id, host, options), ()
            if section.gang_size == 1:
                return WorkerActor.options(**options).remote(engine_config, worker_id, host), ()  # type: ignore[attr-defined]  # a @ray.remote class
            return _create_gang(section, engine_config, host, pg, first_bundle, options)
        except ValueError as e:  # the name is taken
            raise PoolError(
                f"pool {section.name!r}: actor {worker_id!r} already exists in Ray namespace {namespace!r} "
                f"({e}); another `duet serve` is using this Ray cluster: stop it, or give this one "
                "another ray.namespace or pool name") from None

    return make


def _create_drafter(section: PoolSection, engine_config: Any, worker_id: str, host: str | None,
                    options: dict) -> Any:
    """A drafter pool's replica: a DrafterActor (the targets send their vocabulary size with each item)."""
    from workers.spec_decode.drafter_actor import DrafterActor

    d = section.drafter
    return DrafterActor.options(**options).remote(engine_config, None, d.draft_vocab_size, d.threads,  # type: ignore[attr-defined]  # a @ray.remote class
                                                  worker_id=worker_id, host=host, idle_timeout_s=d.idle_timeout_s)


def _create_gang(section: PoolSection, engine_config: Any, host: str | None, pg: Any, first_bundle: int,
                 leader_options: dict) -> tuple[Any, tuple[Any, ...]]:
    """A replica as a gang (expert / sequence / tensor parallel): followers in bundles first_bundle+1.., the leader
    (named like a plain worker) in bundle first_bundle. See workers/server/gang_actor.py."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.parallel.eplb import RebalanceConfig
    from workers.server.gang_actor import GangFollowerActor, GangLeaderActor

    ranks = section.gang_size
    parallel = section.parallel
    named = ({"name": _follower_name(leader_options["name"], r), "namespace": leader_options["namespace"],
              "lifetime": "detached"} if leader_options.get("lifetime") == "detached" else {} for r in range(1, ranks))
    followers = tuple(
        GangFollowerActor.options(  # type: ignore[attr-defined]  # a @ray.remote class
            **rank_actor_options(section, engine_config), max_restarts=section.max_restarts, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + r),
            **extra,
        ).remote(engine_config, parallel, r)
        for r, extra in zip(range(1, ranks), named, strict=True)
    )
    try:
        leader = GangLeaderActor.options(**leader_options).remote(  # type: ignore[attr-defined]  # a @ray.remote class
            engine_config, leader_options["name"], host, parallel, list(followers), RebalanceConfig())
    except BaseException:
        for f in followers:
            ray.kill(f, no_restart=True)
        raise
    return leader, followers


# ---------------------------------------------------------------------------------- what a rank reserves
def rank_bundle(section: PoolSection) -> dict[str, float]:
    """One rank's placement-group bundle: ``cpus_per_replica`` CPUs, ``gpus_per_rank`` GPUs (when >
    0) and the pool's ``resources_per_rank``. With a custom resource only the pool's own nodes
    offer (the Helm chart's ``duet_pool_<name>``), Ray can place the pool's ranks nowhere else, and
    an autoscaler reading the pending bundles adds nodes of that kind only. Example::

        rank_bundle(PoolSection(name="decode", cpus_per_replica=2, gpus_per_rank=1,
                                resources_per_rank={"duet_pool_decode": 1}))
        # {'CPU': 2, 'GPU': 1, 'duet_pool_decode': 1}
    """
    bundle: dict[str, float] = {"CPU": _cpus(section)}
    if section.gpus_per_rank > 0:
        bundle["GPU"] = section.gpus_per_rank
    bundle.update(section.resources_per_rank)
    return bundle


def rank_actor_options(section: PoolSection, engine_config: Any | None = None) -> dict[str, Any]:
    """The Ray actor options of one rank (a plain worker, a gang's leader or follower): exactly its
    bundle, so GPUs are assigned to it (CUDA_VISIBLE_DEVICES) and the custom resources are held;
    with ``engine_config``, the process environment its thread settings need at start (OpenMP
    wait policy, niceness: workers/server/threads.py)."""
    options: dict[str, Any] = {"num_cpus": _cpus(section), "num_gpus": section.gpus_per_rank,
                               "resources": dict(section.resources_per_rank)}
    if engine_config is not None:
        from workers.server.threads import process_env

        options["runtime_env"] = {"env_vars": process_env(engine_config)}
    return options


def _cpus(section: PoolSection) -> int:
    if section.cpus_per_replica is None:
        raise PoolError(f"pool {section.name!r}: cpus_per_replica is unset; fill it in with "
                        "cluster.deploy.cpu_share.resolve_cpus (duet serve does) or set it")
    return section.cpus_per_replica


def _check_embedded_capacity(section: PoolSection, bundle: dict[str, float], cluster: dict[str, float]) -> None:
    """An embedded Ray cannot grow: a pool needing more of any resource than it has fails at once."""
    ranks = section.gang_size
    for name, amount in bundle.items():
        needed, have = (section.replicas + section.standby_replicas) * ranks * amount, cluster.get(name, 0)
        if needed <= have:
            continue
        fix = {"CPU": "cpus_per_replica or raise ray.num_cpus", "GPU": "gpus_per_rank"}.get(
            name, "resources_per_rank (an embedded Ray offers no custom resources; join a cluster whose "
                  "nodes do with ray.address)")
        standby = f" (+ {section.standby_replicas} standby)" if section.standby_replicas else ""
        raise PoolError(
            f"pool {section.name!r} needs {section.replicas} replicas{standby} x {ranks} ranks (ep_size x sp_size x "
            f"tp_size) x {amount:g} {name} = {needed:g} {name}, but the embedded Ray has {have:g}; lower the pool's "
            f"replicas / standby_replicas / ep_size / tp_size / sp_size / {fix}")


def _check_embedded_drafters(section: PoolSection, cluster: dict[str, float]) -> None:
    """Each replica of a draft_model pool starts a drafter actor outside the pool's bundles: an
    embedded Ray must have room for those too, or every worker would wait for its drafter."""
    sp = section.speculative
    if sp.method != "draft_model" or sp.drafter_pool:  # a drafter pool is a pool of its own
        return
    need = {"CPU": section.replicas * (section.gang_size * section.cpus_per_replica + sp.drafter_cpus)}
    need.update({k: section.replicas * v for k, v in dict(sp.drafter_resources).items()})
    for name, amount in need.items():
        if amount > cluster.get(name, 0):
            raise PoolError(
                f"pool {section.name!r}: {section.replicas} workers plus their drafter actors need {amount:g} {name}, "
                f"but the embedded Ray has {cluster.get(name, 0):g}; lower speculative.drafter_cpus or the replicas, "
                "raise ray.num_cpus, or drop speculative.drafter_resources (an embedded Ray offers no custom ones)")


def strict_shortfall(section: PoolSection, bundle: dict[str, float], nodes: list[dict[str, Any]]) -> str | None:
    """What a STRICT_SPREAD / STRICT_PACK pool lacks in the cluster's *alive* nodes (``ray.nodes()``),
    counting each node's total resources (not what is free now: other pools' ranks leave); None
    when the nodes could hold it or the strategy is not strict. STRICT_SPREAD needs one node per
    bundle (replicas x ranks), each offering a bundle; STRICT_PACK one node offering them all.
    Example: 4 bundles of {CPU: 1, duet_pool_x: 1}, STRICT_SPREAD, 3 nodes offering duet_pool_x ->
    "pool 'x': placement_strategy STRICT_SPREAD needs 4 nodes that each offer {CPU: 1, duet_pool_x:
    1} (one per bundle: 4 replicas x 1 ranks), but 3 alive nodes do (...); add 1 such node ..."."""
    strategy, count = section.placement_strategy, section.replicas * section.gang_size
    if strategy not in ("STRICT_SPREAD", "STRICT_PACK"):
        return None
    per_node = bundle if strategy == "STRICT_SPREAD" else {k: v * count for k, v in bundle.items()}
    fits = [n for n in nodes if n.get("Alive") and all(n["Resources"].get(k, 0) >= v for k, v in per_node.items())]
    needed = count if strategy == "STRICT_SPREAD" else 1
    if len(fits) >= needed:
        return None
    which = ", ".join(f"{n['NodeID'][:8]} ({n.get('NodeManagerAddress', '?')})" for n in fits) or "none"
    if strategy == "STRICT_SPREAD":
        return (f"pool {section.name!r}: placement_strategy STRICT_SPREAD needs {count} nodes that each offer "
                f"{_shape(bundle)} (one per bundle: {section.replicas} replicas x {section.gang_size} ranks), but "
                f"{len(fits)} alive nodes do: {which}; add {count - len(fits)} such nodes (with KubeRay: raise the "
                "pool's worker group replicas), lower the pool's replicas, or use placement_strategy SPREAD")
    return (f"pool {section.name!r}: placement_strategy STRICT_PACK needs one node that offers {_shape(per_node)} "
            f"(all {count} bundles of {_shape(bundle)}), but no alive node does; add such a node, lower the pool's "
            "replicas / cpus_per_replica, or use placement_strategy PACK")


def _shape(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"
