"""duet.control.v1.RouterAdmin: the router's own counters, for `duet status` and operators.

Served on the router's public port next to duet.v1.Duet. A snapshot of in-process counters only
(admission, request outcomes, policy events, the router's view of each worker): it never waits on
a worker, so it answers even when every worker is down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from protos.duet.control.v1 import control_pb2, control_pb2_grpc


class RouterAdminServicer(control_pb2_grpc.RouterAdminServicer):
    """``snapshot()`` returns the router's stats dict (RouterServer.stats())."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    async def GetRouterStats(self, request: control_pb2.GetRouterStatsRequest,
                             context: grpc.aio.ServicerContext) -> control_pb2.RouterStats:
        return stats_to_proto(self._snapshot())


def stats_to_proto(s: dict[str, Any]) -> control_pb2.RouterStats:
    adm, req = s["admission"], dict(s["requests"])
    counters = {k: int(v) for k, v in req.items() if k not in ("requests", "cancelled")}
    counters.update({f"policy_{k}": int(v) for k, v in s["policy"].items()})
    counters["admitted_after_queueing"] = int(adm["admitted_after_queueing"])
    workers = [control_pb2.RouterWorker(worker_id=w["worker_id"], endpoint=w["endpoint"], healthy=bool(w["healthy"]),
                                        in_flight=int(w["in_flight"]), load_tokens=int(w["load_tokens"]),
                                        last_error=str(w["last_error"] or "")) for w in s["workers"]]
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
                         "in_flight": w.in_flight, "load_tokens": w.load_tokens, "last_error": w.last_error}
                        for w in r.workers]}
