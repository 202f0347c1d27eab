"""What a deployment on an existing Ray cluster leaves in Ray for the next controller: replica records and a lease.

On an existing cluster (``ray.address`` set: the Helm chart's head, a cluster you run) the worker
actors and placement groups are *detached*: they outlive the ``duet serve`` process that created
them, so a controller that crashes or restarts (a head pod restarted with KubeRay's GCS fault
tolerance, a killed process) does not take the workers and their KV caches with it. The next
``duet serve`` with the same namespace *adopts* them instead of loading new ones
(cluster/deploy/pools.py ``create_pool``). For that it needs what Ray alone does not keep:

    replica record   per worker id: its pool, index, where its bundles are (a slot of the pool's
                     placement group, or a placement group of its own) and its gang followers'
                     actor names. Written when a replica is created, deleted when it is released.
                     A standby replica (loaded, unrouted) is recorded with ``standby`` set, cleared
                     when it is promoted, so the next controller adopts it as a standby again; a
                     draining one with ``drain_until``, so the next controller finishes its drain.
    controller lease who manages the namespace now (host, pid) and when it last said so. A new
                     controller waits until the lease is older than ``LEASE_TTL_S`` before it adopts,
                     so two live controllers never drive the same workers.
    state blobs      what the controller's components carry over a restart (``state_store(name)``:
                     the autoscaler's memory and metrics window, cluster/autoscale/persist.py), one
                     JSON value per name. Written only while this controller holds the lease;
                     dropped with it on a clean shutdown (nothing is left to adopt then).

All live in Ray's internal key-value store (the GCS; with GCS fault tolerance, in its Redis), under
the Ray namespace ``duet`` and keys ``<namespace>/replica/<worker id>``, ``<namespace>/lease`` and
``<namespace>/state/<name>``.
An embedded Ray dies with its ``duet serve``: nothing is recorded there.

Example::

    reg = Registry("duet")
    reg.record(ReplicaRecord("decode", 3, "decode-3", slot=None, own_placement_group="duet-duet-decode-3"))
    reg.records("decode")          # [ReplicaRecord(pool='decode', index=3, ...)]
    reg.forget("decode-3")
    store = reg.state_store("autoscaler")
    store.save({"pools": {...}})   # only while reg holds the lease (after acquire)
    store.load()                   # the dict, or None
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

KV_NAMESPACE = "duet"
LEASE_TTL_S = 10.0  # a lease not renewed for this long belongs to a dead controller
LEASE_RENEW_S = 2.0


@dataclass(frozen=True)
class ReplicaRecord:
    pool: str
    index: int
    worker_id: str
    slot: int | None = None  # bundles slot*gang_size.. of the pool's placement group
    own_placement_group: str | None = None  # else: the name of its own placement group
    followers: tuple[str, ...] = ()  # a gang's follower actors' names, rank order
    standby: bool = False  # loaded and unrouted until promoted (cluster/deploy/controller.py)
    drain_until: float | None = None  # draining (scaled down): wall-clock time its drain's grace ends


class LeaseHeld(RuntimeError):
    """Another live controller manages this namespace."""


class Registry:
    """Replica records and the controller lease of Ray namespace ``namespace`` (module docstring)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- replicas
    def record(self, r: ReplicaRecord) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(self._key(f"replica/{r.worker_id}"), json.dumps(asdict(r)), namespace=KV_NAMESPACE)

    def forget(self, worker_id: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(self._key(f"replica/{worker_id}"), namespace=KV_NAMESPACE)

    def records(self, pool: str | None = None) -> list[ReplicaRecord]:
        """The recorded replicas (of ``pool``), by index."""
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        out = []
        for key in _internal_kv_list(self._key("replica/"), namespace=KV_NAMESPACE):
            raw = _internal_kv_get(key, namespace=KV_NAMESPACE)
            if raw is None:  # deleted meanwhile
                continue
            d = json.loads(raw)
            r = ReplicaRecord(**{**d, "followers": tuple(d.get("followers", ()))})
            if pool is None or r.pool == pool:
                out.append(r)
        return sorted(out, key=lambda r: (r.pool, r.index))

    # ---------------------------------------------------------------- lease
    def acquire(self, wait_s: float = LEASE_TTL_S + 5.0) -> None:
        """Take the namespace's lease, waiting up to ``wait_s`` for a previous holder's to expire
        (a crashed controller's runs out after LEASE_TTL_S); then renew it on a thread until
        ``release``. Raises LeaseHeld if a live controller keeps renewing it."""
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            held = self._lease()
            if held is None or held["owner"] == self._owner or time.time() - held["at"] > LEASE_TTL_S:
                break
            if time.monotonic() > deadline:
                raise LeaseHeld(f"Ray namespace {self.namespace!r} is managed by another duet serve ({held['owner']}, "
                                f"lease renewed {time.time() - held['at']:.0f} s ago); stop it, or give this one "
                                "another ray.namespace")
            if not told:
                logger.info("registry: namespace %r is leased to %s (renewed %.0f s ago); waiting until it is "
                            "%.0f s old (a controller that died) before adopting its workers", self.namespace,
                            held["owner"], time.time() - held["at"], LEASE_TTL_S)
                told = True
            time.sleep(0.5)
        self._renew()
        self._thread = threading.Thread(target=self._keep, name="duet-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and drop the lease and the state blobs (a clean shutdown: the next
        controller need not wait, and has nothing to adopt)."""
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        held = self._lease()
        if held is not None and held["owner"] == self._owner:
            for key in _internal_kv_list(self._key("state/"), namespace=KV_NAMESPACE):
                _internal_kv_del(key, namespace=KV_NAMESPACE)
            _internal_kv_del(self._key("lease"), namespace=KV_NAMESPACE)

    def holds_lease(self) -> bool:
        """Whether this controller holds the namespace's lease now (acquired, not released, not
        taken over by a successor after this one stalled past LEASE_TTL_S)."""
        held = self._lease()
        return self._thread is not None and not self._stop.is_set() and held is not None \
            and held["owner"] == self._owner

    # ---------------------------------------------------------------- state blobs
    def state_store(self, name: str) -> StateBlob:
        """The JSON blob ``name`` of this namespace (module docstring)."""
        return StateBlob(self, name)

    def _put_state(self, name: str, payload: dict) -> bool:
        from ray.experimental.internal_kv import _internal_kv_put

        if not self.holds_lease():
            logger.warning("registry: not saving %s state: this controller does not hold the lease of %r",
                           name, self.namespace)
            return False
        _internal_kv_put(self._key(f"state/{name}"), json.dumps(payload), namespace=KV_NAMESPACE)
        return True

    def _get_state(self, name: str) -> dict | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(self._key(f"state/{name}"), namespace=KV_NAMESPACE)
        return json.loads(raw) if raw else None

    def _keep(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self._renew()
            except Exception as e:  # noqa: BLE001 - the GCS may be restarting (GCS FT): retry next round
                logger.warning("registry: renewing the lease failed: %r", e)

    def _renew(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(self._key("lease"), json.dumps({"owner": self._owner, "at": time.time()}),
                         namespace=KV_NAMESPACE)

    def _lease(self) -> dict | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(self._key("lease"), namespace=KV_NAMESPACE)
        return json.loads(raw) if raw else None

    def _key(self, rest: str) -> str:
        return f"{self.namespace}/{rest}"


class StateBlob:
    """One named JSON blob of a Registry (``Registry.state_store``): ``save`` writes it while the
    registry holds the lease (returns False, logged, when it does not), ``load`` reads it (None: none)."""

    def __init__(self, registry: Registry, name: str) -> None:
        self.registry, self.name = registry, name

    def save(self, payload: dict) -> bool:
        return self.registry._put_state(self.name, payload)

    def load(self) -> dict | None:
        return self.registry._get_state(self.name)
