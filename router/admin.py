"""duet.control.v1.RouterAdmin: the router's own counters, for `duet status` and operators, and
the LoRA adapter admin calls (LoadAdapter, UnloadAdapter, ListAdapters: router/adapter_admin.py).

Served on the router's public port next to duet.v1.Duet, behind the ``admin`` token scope.
GetRouterStats is a snapshot of in-process counters only (admission, request outcomes, policy
events, the router's view of each worker): it never waits on a worker, so it answers even when
every worker is down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from router.adapter_admin import AdapterAdmin
from router.adapters import AdapterError, RegisteredAdapter


class RouterAdminServicer(control_pb2_grpc.RouterAdminServicer):
    """``snapshot()`` returns the router's stats dict (RouterServer.stats()); ``adapters``: the
    adapter admin (None: the adapter calls answer UNIMPLEMENTED)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], adapters: AdapterAdmin | None = None) -> None:
        self._snapshot = snapshot
        self._adapters = adapters

    async def GetRouterStats(self, request: control_pb2.GetRouterStatsRequest,
                             context: grpc.aio.ServicerContext) -> control_pb2.RouterStats:
        return stats_to_proto(self._snapshot())

    async def _admin(self, context: grpc.aio.ServicerContext) -> AdapterAdmin:
        if self._adapters is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no adapter admin")
        assert self._adapters is not None
        return self._adapters

    async def LoadAdapter(self, request: control_pb2.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.AdapterStatus:
        admin = await self._admin(context)
        try:
            adapter = await admin.load(request.name, request.source, request.base_model, preload=request.preload,
                                       pinned=request.pinned)
        except AdapterError as e:
            await context.abort(e.code, e.message)
        return adapter_to_proto(adapter, [])

    async def UnloadAdapter(self, request: control_pb2.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> control_pb2.UnloadAdapterReply:
        admin = await self._admin(context)
        try:
            result = await admin.unload(request.name)
        except AdapterError as e:
            await context.abort(e.code, e.message)
        return control_pb2.UnloadAdapterReply(unloaded_from=list(result.unloaded_from), busy=list(result.busy))

    async def ListAdapters(self, request: control_pb2.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> control_pb2.AdapterStatusList:
        admin = await self._admin(context)
        return control_pb2.AdapterStatusList(adapters=[adapter_to_proto(a, on) for a, on in admin.list()])


def adapter_to_proto(a: RegisteredAdapter, loaded_on: list[str]) -> control_pb2.AdapterStatus:
    return control_pb2.AdapterStatus(name=a.name, base_model=a.base, source=a.spec.source, pinned=a.spec.pinned,
                                     origin=a.origin, loaded_on=loaded_on)


def stats_to_proto(s: dict[str, Any]) -> control_pb2.RouterStats:
    adm, req = s["admission"], dict(s["requests"])
    counters = {k: int(v) for k, v in req.items() if k not in ("requests", "cancelled")}
    counters.update({f"policy_{k}": int(v) for k, v in s["policy"].items()})
    counters["admitted_after_queueing"] = int(adm["admitted_after_queueing"])
    workers = [control_pb2.RouterWorker(worker_id=w["worker_id"], endpoint=w["endpoint"], healthy=bool(w["healthy"]),
                                        in_flight=int(w["in_flight"]), load_tokens=int(w["load_tokens"]),
                                        last_error=str(w["last_error"] or ""), model=str(w.get("model") or ""),
                                        adapters=list(w.get("adapters", ())), pool=str(w.get("pool") or ""))
               for w in s["workers"]]
    return control_pb2.RouterStats(
        policy=s["policy_name"], in_flight=adm["in_flight"], queued=adm["queued"],
        max_in_flight=adm["max_in_flight"], max_queue=adm["max_queue"], requests=int(req.get("requests", 0)),
        admitted=int(adm["admitted"]), rejected=int(adm["rejected"]), cancelled=int(req.get("cancelled", 0)),
        worker_stream_failures=int(s["worker_stream_failures"]), counters=counters, workers=workers,
        membership_version=int(s.get("membership_version", 0)))


def stats_from_proto(r: control_pb2.RouterStats) -> dict[str, Any]:
    """Plain data for JSON output and the status text."""
    return {"policy": r.policy, "in_flight": r.in_flight, "queued": r.queued, "max_in_flight": r.max_in_flight,
            "max_queue": r.max_queue, "requests": r.requests, "admitted": r.admitted, "rejected": r.rejected,
            "cancelled": r.cancelled, "worker_stream_failures": r.worker_stream_failures,
            "counters": dict(sorted(r.counters.items())), "membership_version": r.membership_version,
            "workers": [{"worker_id": w.worker_id, "endpoint": w.endpoint, "healthy": w.healthy,
                         "in_flight": w.in_flight, "load_tokens": w.load_tokens, "last_error": w.last_error,
                         "model": w.model, "adapters": list(w.adapters), "pool": w.pool}
                        for w in r.workers]}
