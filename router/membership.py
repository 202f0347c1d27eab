"""Membership from the controller over gRPC: keep the router's worker set equal to the controller's.

The router opens ``duet.control.v1.Membership/Watch`` on the controller and applies every list it
receives (full lists, see protos/duet/control/v1/control.proto) with ``apply(members, version)``.
When the stream breaks (the controller restarts, the network blips) the router keeps routing over
the last list it applied -- its own health polling still takes dead workers out -- and reconnects
with exponential backoff (``min_backoff_s`` doubling to ``max_backoff_s``); the first list after a
reconnect replaces the old one whole.

Each list also carries the runtime LoRA adapters shared through the controller; ``apply_adapters``
gets them (router/shared_adapters.py ``SharedAdapters.apply``).

``wake_pools`` asks the same service to wake pools scaled to zero (the router's held requests,
router/hold.py).

Example::

    watcher = MembershipWatcher("10.0.0.2:50052", directory_apply, watcher_name="router 10.0.0.3:50051")
    watcher.start()           # on the router's event loop
    await watcher.wait_first(timeout=10)
    ...
    await watcher.stop()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from router.hold import WakeResult

logger = logging.getLogger(__name__)

# (worker_id, endpoint, role, pool, draining, drafter_pool, model): router.workers.MemberInfo; role
# "drafter" members are drafter replicas (the directory hands them to router.drafters.DrafterDirectory)
Members = list[tuple[str, str, str, str, bool, str, str]]
Apply = Callable[[Members, int], Awaitable[None]]
# (the deployment's shared runtime adapters, first list since connecting): router/shared_adapters.py
ApplyAdapters = Callable[[control_pb2.SharedAdapters, bool], None]


class MembershipWatcher:
    """One background task watching the controller at ``address`` (host:port)."""

    def __init__(self, address: str, apply: Apply, *, watcher_name: str = "", min_backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, apply_adapters: ApplyAdapters | None = None) -> None:
        self.address = address
        self._apply = apply
        self._apply_adapters = apply_adapters
        self._name = watcher_name
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()
        self.version = 0  # of the last list applied
        self.num_lists = 0  # lists applied since start
        self.num_reconnects = 0
        self.connected = False

    def start(self) -> None:
        assert self._task is None, "MembershipWatcher.start() called twice"
        self._task = asyncio.ensure_future(self._run())

    async def wait_first(self, timeout: float) -> bool:
        """True once a first list was applied, False if none came within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._first.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = self._min_backoff
        while True:
            try:
                async with grpc.aio.insecure_channel(self.address) as channel:
                    stub = control_pb2_grpc.MembershipStub(channel)
                    async for msg in stub.Watch(control_pb2.WatchRequest(watcher=self._name)):
                        fresh = not self.connected
                        if fresh:
                            self.connected = True
                            logger.info("membership: watching the controller at %s", self.address)
                        if self._apply_adapters is not None and msg.HasField("adapters"):
                            self._apply_adapters(msg.adapters, fresh)
                        backoff = self._min_backoff
                        await self._apply([(m.worker_id, m.endpoint, m.role or "colocated", m.pool or m.role or "colocated",
                                            m.draining, m.drafter_pool, m.model) for m in msg.members], msg.version)
                        self.version = msg.version
                        self.num_lists += 1
                        self._first.set()
                    reason = "the controller ended the stream"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except Exception as e:  # a bug in apply(): keep watching, but say so loudly
                logger.exception("membership: applying a member list failed")
                reason = f"{type(e).__name__}: {e}"
            if self.connected:
                logger.warning("membership: lost the controller at %s (%s); routing over member list version %d meanwhile; "
                               "reconnecting", self.address, reason, self.version)
            else:
                logger.debug("membership: controller at %s not reachable (%s); retrying in %.1f s",
                             self.address, reason, backoff)
            self.connected = False
            self.num_reconnects += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)


async def wake_pools(address: str, roles: tuple[str, ...] | list[str], requester: str = "",
                     timeout_s: float = 5.0) -> WakeResult:
    """Ask the controller at ``address`` to wake the pools of ``roles`` scaled to zero
    (duet.control.v1.Membership/Wake); router/hold.py calls this for a held request."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await control_pb2_grpc.MembershipStub(channel).Wake(
            control_pb2.WakeRequest(roles=list(roles), requester=requester), timeout=timeout_s)
    return WakeResult(tuple(reply.woken), tuple(reply.waking), tuple(reply.from_standby))
