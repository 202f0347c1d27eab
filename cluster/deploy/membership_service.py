"""The controller's duet.control.v1.Membership service: routers follow the member list over gRPC.

``serve_membership(controller, host, port)`` subscribes to the controller (cluster/deploy/controller.py)
and serves ``Watch``: each watcher gets the current list at once, then the full list after every
change. Each member carries its role, pool and model (the served name of its pool's ``model``; ""
for the default model: routers route by it, router/pipeline.py) (drafter replicas are members with role "drafter"; a
target carries the drafter pool its requests draft on); a replica the autoscaler is draining stays listed
with ``draining`` set (routers send it nothing new and let its streams finish) until it is gone. A watch is one long-lived server stream parked on a condition variable, so a thread of
the server's pool per watcher (``max_watchers``; routers are few). Stopping the service ends every
stream (the routers then keep their last list and reconnect, see router/membership.py).

``PutAdapter`` / ``DeleteAdapter``: the runtime LoRA adapters a router's admin API loaded or
unloaded (router/shared_adapters.py), kept here (and with ``adapters_store``, the registry's Ray KV
blob ``adapters``: a restarted controller has them) and sent with every MemberList, so every router
-- one started later, or restarted -- serves the same adapters.

``Wake`` (a router holds a request no member can take) wakes the pools of the roles it names that
are scaled to zero, through the ``wake`` callable ``duet serve`` installs (cluster/deploy/wake.py
``PoolWaker.wake``); without one, nothing sleeps and the reply is empty.

The same server answers grpc.health.v1 (service "" and "duet.control.v1.Membership"): SERVING
from the moment it listens -- which ``duet serve`` reaches only once its workers are up, so a
Kubernetes startup probe on this port waits out model loading -- and NOT_SERVING once stopping.

Example::

    service = serve_membership(controller, "127.0.0.1", 50052)
    service.address          # "127.0.0.1:50052"; routers run with --membership 127.0.0.1:50052
    service.stop()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.autoscale.persist import StateStore
from cluster.deploy.controller import MemberDetails, Members
from protos.duet.control.v1 import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)

MEMBERSHIP_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Membership"].full_name  # "duet.control.v1.Membership"


class MembershipError(RuntimeError):
    """The membership service could not listen; the message names the setting to change."""


class MembershipServicer(control_pb2_grpc.MembershipServicer):
    """Holds the latest list (and its version) and wakes every parked Watch when it changes."""

    def __init__(self, role_of: Callable[[str], str] = lambda worker_id: "colocated",
                 drafter_pool_of: Callable[[str], str] = lambda worker_id: "",
                 wake: Callable[[list[str], str], Any] | None = None,
                 model_of: Callable[[str], str] = lambda worker_id: "",
                 adapters_store: StateStore | None = None) -> None:
        self._role_of = role_of  # worker id -> pool role, sent with each member
        self._drafter_pool_of = drafter_pool_of  # worker id -> the drafter pool its requests draft on
        self._model_of = model_of  # worker id -> the served model of its pool ("" = the default model)
        self._wake_pools = wake  # (roles, requester) -> cluster.deploy.wake.WakeOutcome
        self._cond = threading.Condition()
        self._version = 0
        self._message = control_pb2.MemberList()
        self._members: Members | MemberDetails | None = None
        self._closed = False
        self.num_watchers = 0
        # runtime LoRA adapters shared by the routers: name -> SharedAdapter, and the list's revision
        self._store = adapters_store
        saved = adapters_store.load() if adapters_store is not None else None
        self._adapters = {a["name"]: control_pb2.SharedAdapter(**a) for a in (saved or {}).get("adapters", [])}
        self._revision = int((saved or {}).get("revision", 0))
        if self._adapters:
            logger.info("membership: %d shared adapters restored (%s)", len(self._adapters), ", ".join(self._adapters))

    def publish(self, members: Members | MemberDetails) -> None:
        """The controller's subscriber: called with the full list after every change, as
        (worker_id, endpoint) pairs or ``Controller.member_details()`` entries (role, pool, draining)."""
        with self._cond:
            if members == self._members:
                return
            self._members = members.copy()
            self._republish()

    def _republish(self) -> None:
        """A new MemberList from the members and shared adapters (the caller holds ``_cond``)."""
        self._version += 1
        self._message = control_pb2.MemberList(version=self._version,
                                               members=[self._member(m) for m in self._members or []],
                                               adapters=self._shared())
        self._cond.notify_all()

    def _shared(self) -> control_pb2.SharedAdapters:
        return control_pb2.SharedAdapters(revision=self._revision,
                                          adapters=[self._adapters[n] for n in sorted(self._adapters)])

    def _member(self, m: tuple) -> control_pb2.Member:
        if len(m) == 2:
            return control_pb2.Member(worker_id=m[0], endpoint=m[1], role=self._role_of(m[0]),
                                      model=self._model_of(m[0]))
        worker_id, endpoint, role, pool, draining = m
        return control_pb2.Member(worker_id=worker_id, endpoint=endpoint, role=role, pool=pool, draining=draining,
                                  drafter_pool=self._drafter_pool_of(worker_id), model=self._model_of(worker_id))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def Watch(self, request: control_pb2.WatchRequest, context: grpc.ServicerContext) -> Iterator[control_pb2.MemberList]:
        who = request.watcher or context.peer()
        context.add_callback(self._wake)  # the watcher went away: stop parking
        with self._cond:
            self.num_watchers += 1
        logger.info("membership: %s is watching", who)
        seen = 0
        try:
            while True:
                with self._cond:
                    while (self._version == seen or self._members is None) and not self._closed and context.is_active():
                        self._cond.wait(timeout=5.0)
                    if self._closed or not context.is_active():
                        return
                    seen, message = self._version, self._message
                yield message
        finally:
            with self._cond:
                self.num_watchers -= 1
            logger.info("membership: %s stopped watching", who)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---------------------------------------------------------------- shared adapters
    def PutAdapter(self, request: control_pb2.SharedAdapter, context: grpc.ServicerContext) -> control_pb2.SharedAdapters:
        if not request.name or not request.source or not request.base_model:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name, source and base_model are required")
        with self._cond:
            held = self._adapters.get(request.name)
            if held is not None and held != request:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"adapter {request.name!r} is already shared on {held.base_model} (source {held.source}"
                              f"{', pinned' if held.pinned else ''}); unload it first")
            if held is None:
                self._adapters[request.name] = control_pb2.SharedAdapter()
                self._adapters[request.name].CopyFrom(request)
                self._changed_adapters(f"{request.name} shared on {request.base_model} ({request.source})")
            return self._shared()

    def DeleteAdapter(self, request: control_pb2.DeleteAdapterRequest,
                      context: grpc.ServicerContext) -> control_pb2.SharedAdapters:
        with self._cond:
            if self._adapters.pop(request.name, None) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no shared adapter named {request.name!r}")
            self._changed_adapters(f"{request.name} unshared")
            return self._shared()

    def _changed_adapters(self, what: str) -> None:
        """Bump the revision, keep the list (the registry, when there is one), tell every watcher."""
        self._revision += 1
        if self._store is not None:
            self._store.save({"revision": self._revision, "adapters": [
                {"name": a.name, "source": a.source, "base_model": a.base_model, "pinned": a.pinned}
                for a in self._adapters.values()]})
        logger.info("membership: adapter %s (revision %d)", what, self._revision)
        if self._members is not None:
            self._republish()

    def Wake(self, request: control_pb2.WakeRequest, context: grpc.ServicerContext) -> control_pb2.WakeReply:
        if self._wake_pools is None:
            return control_pb2.WakeReply()
        try:
            out = self._wake_pools(list(request.roles), request.requester or context.peer())
        except Exception as e:
            logger.exception("membership: waking pools for %s failed", request.requester or context.peer())
            context.abort(grpc.StatusCode.INTERNAL, f"waking pools failed: {e}")
        return control_pb2.WakeReply(woken=list(out.woken), waking=list(out.waking),
                                     from_standby=list(out.from_standby))


class MembershipService:
    """A started Membership server (``serve_membership``)."""

    def __init__(self, server: grpc.Server, servicer: MembershipServicer, health_servicer: health.HealthServicer,
                 host: str, port: int) -> None:
        self._server = server
        self.servicer = servicer
        self.health = health_servicer
        self.port = port
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
        self.address = f"[{connect_host}]:{port}" if ":" in connect_host and not connect_host.startswith("[") \
            else f"{connect_host}:{port}"

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.servicer.close()
        self._server.stop(grace).wait(grace + 5)


class MemberSource(Protocol):
    """What serve_membership follows: the controller (cluster/deploy/controller.py), or StaticMembers."""

    def role_of(self, worker_id: str) -> str: ...

    def drafter_pool_of(self, worker_id: str) -> str: ...

    def model_of(self, worker_id: str) -> str: ...

    def subscribe(self, push: Callable[[Any], None], *, detailed: bool = False) -> None: ...


class StaticMembers:
    """A fixed member list of (worker id, endpoint) in place of a controller: every worker colocated,
    in no drafter pool, serving the default model. For routers in front of workers started without a
    controller (benchmarks, tests)."""

    def __init__(self, members: list[tuple[str, str]]) -> None:
        self.members = members

    def role_of(self, worker_id: str) -> str:
        return "colocated"

    def drafter_pool_of(self, worker_id: str) -> str:
        return ""

    def model_of(self, worker_id: str) -> str:
        return ""  # the default model

    def subscribe(self, push: Callable[[Any], None], *, detailed: bool = False) -> None:
        push(self.members)


def serve_membership(controller: MemberSource, host: str, port: int, *, max_watchers: int = 16,
                     wake: Callable[[list[str], str], Any] | None = None,
                     adapters_store: StateStore | None = None) -> MembershipService:
    """Listen on host:port (0 = any free port) and follow ``controller``'s member list. wake:
    answers Wake (cluster/deploy/wake.py ``PoolWaker.wake``); None = nothing sleeps. adapters_store:
    where the shared adapters are kept (the registry's, on an existing cluster); None = in memory."""
    servicer = MembershipServicer(controller.role_of, controller.drafter_pool_of, wake, controller.model_of,
                                  adapters_store)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_watchers, thread_name_prefix="duet-membership"),
                         options=[("grpc.so_reuseport", 0)])
    control_pb2_grpc.add_MembershipServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise MembershipError(f"controller.port={port}: cannot listen on {bind} ({e}); is another `duet serve` "
                              "running? pick another --controller-port (0 = any free port)") from None
    server.start()
    controller.subscribe(servicer.publish, detailed=True)
    for name in ("", MEMBERSHIP_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    service = MembershipService(server, servicer, health_servicer, host, bound)
    logger.info("membership service on %s", service.address)
    return service
