"""SharedAdapters: runtime LoRA adapters known to every router of a deployment, through the controller.

An adapter loaded at runtime through one router's admin API (router/adapter_admin.py) would be
known to that router only. With a controller (``membership_address``: ``duet serve``, or a router
run with ``--membership``), the router that takes the call *shares* it: ``put`` sends it to the
controller (duet.control.v1.Membership/PutAdapter), which keeps the deployment's list (in Ray, on an
existing cluster: cluster/deploy/membership_service.py) and sends it with every MemberList. Every
router ``apply``s each list it receives: its runtime adapters (router/adapters.py, origin
``runtime``) become exactly that list. So a router started later, or restarted, serves the same
adapters, and an unload (``delete``) through any router stops them everywhere.

Order: each list has a ``revision`` that only grows (kept with the list across controller restarts);
a list older than the last one applied is skipped -- a MemberList pushed before a PutAdapter's
reply arrives after it -- except the first list after the router (re)connects, which replaces
everything (a new deployment's controller starts again at 0).

The controller is the source of truth, not the workers' load reports: a report lists what a worker
holds now (its LRU evicts), and an adapter registered without ``preload`` is on no worker yet.

Example::

    shared = SharedAdapters("10.0.0.2:50052", catalog.adapters)
    await shared.put(registered)      # AdapterError(ALREADY_EXISTS) if another router shared the name otherwise
    shared.apply(member_list.adapters, fresh=False)
    await shared.delete("chat")
"""

from __future__ import annotations

import logging

import grpc

from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from router.adapters import AdapterError, AdapterRegistry, RegisteredAdapter
from router.config import AdapterSpec, RouterConfigError

logger = logging.getLogger(__name__)


class SharedAdapters:
    """Single event loop (the router's)."""

    def __init__(self, address: str, registry: AdapterRegistry, *, timeout_s: float = 10.0) -> None:
        self.address = address
        self.registry = registry
        self.timeout_s = timeout_s
        self.revision = -1  # of the last list applied (-1: none yet)
        self.num_applied = 0
        self.num_stale = 0  # lists skipped as older than the one applied

    def apply(self, shared: control_pb2.SharedAdapters, *, fresh: bool) -> None:
        """Make the registry's runtime adapters ``shared``'s (unless it is stale: module docstring).
        fresh: the first list since (re)connecting to the controller."""
        if not fresh and shared.revision < self.revision:
            self.num_stale += 1
            return
        entries = []
        for a in shared.adapters:
            try:
                entries.append((AdapterSpec(a.name, a.source, a.pinned), a.base_model))
            except RouterConfigError as e:  # the controller checks less than a router: skip it, say so
                logger.warning("shared adapter %s skipped: %s", a.name, e)
        self.revision = shared.revision
        self.num_applied += 1
        self.registry.replace_runtime(entries)

    async def put(self, adapter: RegisteredAdapter) -> None:
        """Share ``adapter`` with every router; raises AdapterError (ALREADY_EXISTS, or UNAVAILABLE
        when the controller cannot be reached: it is then not shared, and the caller undoes it)."""
        request = control_pb2.SharedAdapter(name=adapter.name, source=adapter.spec.source, base_model=adapter.base,
                                            pinned=adapter.spec.pinned)
        self.apply(await self._call("PutAdapter", request, adapter.name), fresh=False)

    async def delete(self, name: str) -> None:
        """Stop sharing ``name``; NOT_FOUND at the controller (never shared) is no error."""
        try:
            reply = await self._call("DeleteAdapter", control_pb2.DeleteAdapterRequest(name=name), name)
        except AdapterError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            return
        self.apply(reply, fresh=False)

    async def _call(self, method: str, request: object, name: str) -> control_pb2.SharedAdapters:
        try:
            async with grpc.aio.insecure_channel(self.address) as channel:
                stub = control_pb2_grpc.MembershipStub(channel)
                return await getattr(stub, method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.INVALID_ARGUMENT):
                raise AdapterError(e.code(), f"lora_name: {e.details()}") from None
            raise AdapterError(grpc.StatusCode.UNAVAILABLE,
                               f"adapter {name}: the controller at {self.address} did not answer {method} "
                               f"({e.code().name}: {e.details()}), so the other routers would not know it; "
                               "retry") from None
