"""``duet drain``: empty workers of a running deployment by live migration, from the outside.

It joins the deployment's Ray cluster like ``duet status`` (the worker actors, their endpoints),
picks the workers to drain (one by id, or every worker whose endpoint is on one node: what a
Kubernetes preStop hook passes, ``--node-ip $POD_IP``), and calls each one's Drain RPC with the
other serving workers of its pool as targets (workers/handoff/drain.py): the worker stops taking new
requests (health NOT_SERVING, so routers stop routing to it) and its running requests continue on
the targets without recomputation. The worker process stays up, empty, until whoever owns it
stops it (the pod's termination after the hook, or the autoscaler).

Example::

    $ duet drain decode-1
    decode-1: 8 requests migrated, 0 failed attempts, 0 left, 0.42 s
"""

from __future__ import annotations

from typing import Any


class DrainError(Exception):
    """Nothing to drain: no such worker, or no worker on that node (the message says which)."""


def select(workers: list[dict[str, Any]], worker_id: str | None, node_ip: str | None) -> list[dict[str, Any]]:
    """The entries (from cluster.deploy.status.worker_status) to drain. Raises DrainError. Drafter
    replicas are never drained (their state is a cache: their targets go on without drafts)."""
    workers = [w for w in workers if w.get("role") != "drafter"]
    if worker_id is not None:
        chosen = [w for w in workers if w["worker_id"] == worker_id]
        if not chosen:
            known = ", ".join(w["worker_id"] for w in workers) or "none"
            raise DrainError(f"worker {worker_id!r} not found (workers: {known})")
        return chosen
    chosen = [w for w in workers if w.get("endpoint") and _host(w["endpoint"]) == node_ip]
    if not chosen:
        raise DrainError(f"no worker serves on node {node_ip!r}")
    return chosen


def targets_for(victim: dict[str, Any], workers: list[dict[str, Any]], draining: set[str]) -> list[tuple[str, str, str]]:
    """(worker id, endpoint, incarnation) of the serving workers of the victim's pool, not being drained."""
    return [(w["worker_id"], w["endpoint"], w.get("incarnation") or "") for w in workers
            if w["pool"] == victim["pool"] and w["worker_id"] not in draining and w.get("endpoint")
            and w.get("health") == "SERVING"]


def drain(victims: list[dict[str, Any]], workers: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Drain each victim (one after the other) to its pool's other workers -> one result dict each."""
    import grpc

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    names = {v["worker_id"] for v in victims}
    results = []
    for v in victims:
        out: dict[str, Any] = {"worker_id": v["worker_id"]}
        peers = targets_for(v, workers, names)
        if not v.get("endpoint"):
            out["error"] = v.get("error", "not serving")
            results.append(out)
            continue
        request = worker_pb2.DrainRequest(timeout_s=timeout_s, targets=[
            worker_pb2.MigrationTarget(worker_id=w, endpoint=e, incarnation=i) for w, e, i in peers])
        with grpc.insecure_channel(v["endpoint"]) as channel:
            try:
                r = worker_pb2_grpc.WorkerStub(channel).Drain(request, timeout=timeout_s + 10)
            except grpc.RpcError as e:
                out["error"] = f"gRPC: {e.code().name}: {e.details()}"
            else:
                out.update(migrated=r.migrated, failed=r.failed, remaining=r.remaining, seconds=round(r.seconds, 3),
                           targets=[w for w, _, _ in peers])
        results.append(out)
    return results


def format_results(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        if "error" in r:
            lines.append(f"{r['worker_id']}: not drained ({r['error']})")
        else:
            lines.append(f"{r['worker_id']}: {r['migrated']} requests migrated, {r['failed']} failed attempts, "
                         f"{r['remaining']} left, {r['seconds']:.2f} s"
                         + ("" if r["targets"] else " (no other serving worker in its pool: nothing could move)"))
    return "\n".join(lines)


def _host(endpoint: str) -> str:
    host = endpoint.rsplit(":", 1)[0]
    return host.strip("[]")
