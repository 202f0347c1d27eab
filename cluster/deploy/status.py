"""``duet status``: what a running deployment consists of, asked from the outside.

How status reaches a running ``duet serve`` (no extra service, nothing to configure):
    router    --target host:port: grpc health, ListModels and duet.control.v1.RouterAdmin
              GetRouterStats (in flight / queued, request outcomes, its view of each worker) on
              the public port.
    workers   through Ray: join the deployment's Ray cluster as a short-lived driver
              (``--ray-address``, default "auto" = the local Ray that ``duet serve`` started, or
              ``RAY_ADDRESS``), list the named worker actors in the deployment's namespace
              ("duet"), ask each for ``info()`` (endpoint, incarnation, pid, Ray node), then ask each
              worker's gRPC endpoint directly for health and ``GetLoad`` (running / waiting
              requests, outstanding tokens, KV blocks used / total, prefix-cache hits).
A worker whose actor does not answer within the timeout is listed with its error rather than
hiding it.

Example output::

    router 127.0.0.1:50051: SERVING, model SmolLM2-135M-Instruct (context 1456)
      adapters: sql (on SmolLM2-135M-Instruct)
      policy prefix_aware, in flight 1/128, queued 0/512; requests 12 (rejected 0, cancelled 1),
      2 workers healthy of 2, member list v3
    pool default (model SmolLM2-135M-Instruct): 2 workers, 1 standby
      default-0  10.0.0.5:41231  SERVING  running 1 waiting 0  outstanding 40 tok  KV 3/91 blocks  pid 1234  node 5c1a09e2
      default-1  10.0.0.5:40877  SERVING  running 0 waiting 0  outstanding 0 tok   KV 0/91 blocks  pid 1240  node 8f03b7d1
                 migrations: 8 out, 0 in, 0 failed, 36.9 MB; draining
      default-2  -               STANDBY  loaded, unrouted (promoted first on a scale-up)  pid 1251  node 5c1a09e2
    pool drafters: 1 drafters
      drafters-0 10.0.0.7:40111  SERVING  requests 3 (drafting 2)  streams 2  KV 5/400 blocks  mean batch 2.6  pid 1250  node 77aa01c3
                 rounds 812, 2904 draft tokens, 0 evicted, 0 expired
(the migrations line appears once a worker has migrated or is draining: workers/handoff/migration_service.py;
a STANDBY worker is a loaded, unrouted spare: cluster/deploy/controller.py; pools are grouped by the
model the router says their workers serve, with the LoRA adapters each holds)
"""

from __future__ import annotations

import re
from typing import Any

_WORKER_NAME = re.compile(r"^(?P<pool>[a-z][a-z0-9_]*)-(?P<index>\d+)$")


def router_status(target: str, timeout: float = 5.0, *, tls: Any = None, token: str | None = None) -> dict[str, Any]:
    """Health and models of the router at ``target`` (an ``error`` key if unreachable). tls: a
    router.client.ClientTLS; token: a bearer token with the admin scope (RouterAdmin needs it)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.duet.control.v1 import control_pb2, control_pb2_grpc
    from protos.duet.v1 import duet_pb2, duet_pb2_grpc
    from router.admin import stats_from_proto
    from router.client import auth_metadata, open_channel

    out: dict[str, Any] = {"target": target}
    md = auth_metadata(token)
    with open_channel(target, tls=tls, aio=False) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            models = duet_pb2_grpc.DuetStub(channel).ListModels(duet_pb2.ListModelsRequest(), timeout=timeout,
                                                                metadata=md)
            out["models"] = [{"name": m.name, "max_model_len": m.max_model_len, "is_default": m.is_default,
                              "parent": m.parent} for m in models.models]
            stats = control_pb2_grpc.RouterAdminStub(channel).GetRouterStats(control_pb2.GetRouterStatsRequest(),
                                                                              timeout=timeout, metadata=md)
            out["stats"] = stats_from_proto(stats)
        except grpc.RpcError as e:
            out["error"] = f"{e.code().name}: {e.details()}"
    return out


def worker_status(namespace: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Every Duet worker actor in ``namespace`` with its info, health and load. Ray must be
    initialised in this process (``duet status`` connects first)."""
    import ray

    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    workers = []
    for name in sorted(named, key=_sort_key):
        m = _WORKER_NAME.match(name)
        if m is None:
            continue
        entry: dict[str, Any] = {"pool": m.group("pool"), "worker_id": name}
        try:
            info: Any = ray.get(ray.get_actor(name, namespace=namespace).info.remote(), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - dead, restarting or slow: report, don't hide
            entry["error"] = f"actor: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            workers.append(entry)
            continue
        entry.update(endpoint=info.get("endpoint"), incarnation=info.get("incarnation"), pid=info.get("pid"),
                     node_id=info.get("node_id"), standby=bool(info.get("standby")), role=info.get("role", "worker"))
        if entry["standby"]:
            pass  # loaded, unrouted: promoted first on a scale-up
        elif entry["endpoint"] is None:
            entry["error"] = "not serving (starting, or restarted by Ray and not started yet)"
        elif entry["role"] == "drafter":
            entry.update(_drafter_load(entry["endpoint"], timeout))
        else:
            entry.update(_worker_load(entry["endpoint"], timeout))
        workers.append(entry)
    return workers


def _sort_key(name: str) -> tuple[str, int]:
    m = _WORKER_NAME.match(name)
    return (m.group("pool"), int(m.group("index"))) if m else (name, -1)


def _worker_load(endpoint: str, timeout: float) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(endpoint) as channel:
        try:
            h = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="duet.worker.v1.Worker"), timeout=timeout)
            r = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return {"error": f"gRPC: {e.code().name}: {e.details()}"}
    return {"health": health_pb2.HealthCheckResponse.ServingStatus.Name(h.status),
            "load": {"num_running": r.num_running, "num_waiting": r.num_waiting,
                     "outstanding_tokens": r.outstanding_tokens, "kv_blocks_used": r.kv_blocks_used,
                     "kv_blocks_total": r.kv_blocks_total, "prefix_cache_queries": r.prefix_cache_queries,
                     "prefix_cache_hits": r.prefix_cache_hits, "num_preemptions": r.num_preemptions,
                     "spec_method": r.spec_method or "none", "spec_draft_tokens": r.spec_draft_tokens,
                     "spec_accepted_tokens": r.spec_accepted_tokens, "spec_verifies": r.spec_verifies,
                     "spec_emitted_tokens": r.spec_emitted_tokens, "spec_fallbacks": r.spec_fallbacks,
                     "kv_transfers_sent": r.kv_transfers_sent, "kv_transfers_received": r.kv_transfers_received,
                     "kv_bytes_sent": r.kv_bytes_sent, "kv_bytes_received": r.kv_bytes_received,
                     "kv_transfer_failures": r.kv_transfer_failures, "prefix_pulls": r.prefix_pulls,
                     "prefix_pull_blocks": r.prefix_pull_blocks, "prefix_pull_bytes": r.prefix_pull_bytes,
                     "prefix_pull_failures": r.prefix_pull_failures, "prefix_pulls_served": r.prefix_pulls_served,
                     "prefix_pull_tier_blocks_served": r.prefix_pull_tier_blocks_served,
                     "migrations_out": r.migrations_out, "migrations_in": r.migrations_in,
                     "migration_failures": r.migration_failures, "migration_kv_bytes": r.migration_kv_bytes,
                     "draining": r.draining,
                     **{f: getattr(r, f) for f in ("tier_host_bytes", "tier_disk_bytes", "tier_host_hits",
                                                   "tier_disk_hits", "tier_host_evictions", "tier_disk_evictions",
                                                   "tier_refused_corrupt", "tier_refused_foreign",
                                                   "tier_deadline_misses", "tier_bytes_to_host",
                                                   "tier_bytes_to_disk", "tier_bytes_loaded",
                                                   "tier_load_seconds")}}}


def _drafter_load(endpoint: str, timeout: float) -> dict[str, Any]:
    """A drafter replica's DrafterLoad (workers/spec_decode/drafter_service.py), as a dict."""
    import grpc

    from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc

    with grpc.insecure_channel(endpoint) as channel:
        try:
            r = drafter_pb2_grpc.DrafterStub(channel).GetLoad(drafter_pb2.GetDrafterLoadRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return {"error": f"gRPC: {e.code().name}: {e.details()}"}
    return {"health": "SERVING", "load": {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}}


def _format_drafter(w: dict[str, Any]) -> list[str]:
    ld = w["load"]
    batch = ld["batched_rows"] / ld["forward_passes"] if ld["forward_passes"] else 0.0
    return [f"  {w['worker_id']:<12} {w['endpoint']:<22} {w['health']:<11} requests {ld['num_requests']} (drafting "
            f"{ld['num_active']})  streams {ld['num_streams']}  KV {ld['kv_blocks_used']}/{ld['kv_blocks_total']} "
            f"blocks  mean batch {batch:.1f}  pid {w['pid']}{_node(w)}",
            f"  {'':<12} rounds {ld['rounds']}, {ld['draft_tokens']} draft tokens, {ld['evictions']} evicted, "
            f"{ld['expired']} expired"]


def _node(w: dict[str, Any]) -> str:
    """`` node 1a2b3c4d``: the first 8 hex digits of the worker's Ray node id (as `ray status` abbreviates)."""
    return f"  node {w['node_id'][:8]}" if w.get("node_id") else ""


def _router_view(r: dict[str, Any] | None) -> tuple[dict[str, str], dict[str, list[str]]]:
    """worker id -> the model it serves and -> the adapters it holds, as the router sees them
    (empty without a reachable router: pools are then listed without their model)."""
    if r is None or "error" in r or r.get("stats") is None:
        return {}, {}
    default = next((m["name"] for m in r.get("models", []) if m.get("is_default")), "")
    workers = r["stats"]["workers"]
    return ({w["worker_id"]: w.get("model") or default for w in workers},
            {w["worker_id"]: list(w.get("adapters", ())) for w in workers})


def _pool_model(members: list[dict[str, Any]], model_of: dict[str, str]) -> str:
    return next((model_of[w["worker_id"]] for w in members if w["worker_id"] in model_of), "")


def format_status(status: dict[str, Any]) -> str:
    """Human-readable text of ``{"router": ..., "workers": [...] | None, "ray_error": ...}``."""
    lines = []
    r = status.get("router")
    if r is not None:
        if "error" in r:
            lines.append(f"router {r['target']}: unreachable ({r['error']})")
        else:
            bases = [m for m in r.get("models", []) if not m.get("parent")]
            models = ", ".join(f"{m['name']} (context {m['max_model_len']})" for m in bases)
            lines.append(f"router {r['target']}: {r['health']}, model{'s' if len(bases) > 1 else ''} "
                         f"{models or '(none)'}")
            adapters = [m for m in r.get("models", []) if m.get("parent")]
            if adapters:
                listed = ", ".join(f"{m['name']} (on {m['parent']})" for m in adapters)
                lines.append(f"  adapters: {listed}")
            st = r.get("stats")
            if st is not None:
                healthy = sum(w["healthy"] for w in st["workers"])
                lines.append(f"  policy {st['policy']}, in flight {st['in_flight']}/{st['max_in_flight']}, queued "
                             f"{st['queued']}/{st['max_queue']}; requests {st['requests']} (rejected {st['rejected']}, "
                             f"cancelled {st['cancelled']}), {healthy} workers healthy of {len(st['workers'])}, "
                             f"member list v{st['membership_version']}")
    if status.get("ray_error"):
        lines.append(f"workers: unknown ({status['ray_error']})")
    workers = status.get("workers")
    if workers is not None and not workers:
        lines.append(f"workers: none in Ray namespace {status.get('namespace')!r} (is `duet serve` running there?)")
    pools: dict[str, list[dict[str, Any]]] = {}
    for w in workers or []:
        pools.setdefault(w["pool"], []).append(w)
    model_of, adapters_of = _router_view(r)
    for pool, members in sorted(pools.items(), key=lambda kv: (_pool_model(kv[1], model_of), kv[0])):
        spares = sum(bool(w.get("standby")) for w in members)
        kind = "drafters" if any(w.get("role") == "drafter" for w in members) else "workers"
        model = _pool_model(members, model_of)
        lines.append(f"pool {pool}{f' (model {model})' if model else ''}: {len(members) - spares} {kind}"
                     + (f", {spares} standby" if spares else ""))
        for w in members:
            if w.get("standby"):
                lines.append(f"  {w['worker_id']:<12} {'-':<22} STANDBY     loaded, unrouted (promoted first on a "
                             f"scale-up)  pid {w['pid']}{_node(w)}")
                continue
            if "error" in w:
                lines.append(f"  {w['worker_id']:<12} {w.get('endpoint') or '-':<22} {w['error']}")
                continue
            if w.get("role") == "drafter":
                lines.extend(_format_drafter(w))
                continue
            ld = w["load"]
            hits = f"{ld['prefix_cache_hits']}/{ld['prefix_cache_queries']}"
            lines.append(f"  {w['worker_id']:<12} {w['endpoint']:<22} {w['health']:<11} running {ld['num_running']} "
                         f"waiting {ld['num_waiting']}  outstanding {ld['outstanding_tokens']} tok  KV "
                         f"{ld['kv_blocks_used']}/{ld['kv_blocks_total']} blocks  prefix hits {hits}  pid {w['pid']}"
                         f"{_node(w)}")
            if adapters_of.get(w["worker_id"]):
                lines.append(f"  {'':<12} adapters loaded: {', '.join(adapters_of[w['worker_id']])}")
            if ld.get("migrations_out") or ld.get("migrations_in") or ld.get("migration_failures") or ld.get("draining"):
                lines.append(f"  {'':<12} migrations: {ld['migrations_out']} out, {ld['migrations_in']} in, "
                             f"{ld['migration_failures']} failed, {ld['migration_kv_bytes'] / 1e6:.1f} MB"
                             + ("; draining" if ld["draining"] else ""))
            if ld.get("spec_method", "none") != "none":
                rate = ld["spec_accepted_tokens"] / max(ld["spec_draft_tokens"], 1)
                length = ld["spec_emitted_tokens"] / max(ld["spec_verifies"], 1)
                lines.append(f"  {'':<12} speculative {ld['spec_method']}: acceptance {rate:.0%}, {length:.2f} tokens "
                             f"per verify, {ld['spec_fallbacks']} fallbacks")
            if ld.get("tier_host_bytes") or ld.get("tier_host_hits") or ld.get("tier_disk_hits"):
                lines.append(f"  {'':<12} KV tiers: host {ld['tier_host_bytes'] / 1e6:.1f} MB ({ld['tier_host_hits']} "
                             f"hits, {ld['tier_host_evictions']} evicted), disk {ld['tier_disk_bytes'] / 1e6:.1f} MB "
                             f"({ld['tier_disk_hits']} hits, {ld['tier_disk_evictions']} evicted), refused "
                             f"{ld['tier_refused_corrupt']} corrupt / {ld['tier_refused_foreign']} foreign, "
                             f"{ld['tier_deadline_misses']} deadline misses")
                lines.append(f"  {'':<12} KV tiers moved: {ld.get('tier_bytes_to_host', 0) / 1e6:.1f} MB to host, "
                             f"{ld.get('tier_bytes_to_disk', 0) / 1e6:.1f} MB to disk, "
                             f"{ld.get('tier_bytes_loaded', 0) / 1e6:.1f} MB loaded back; load "
                             f"{_per_block_ms(ld.get('tier_load_seconds', 0.0), ld['tier_host_hits'])} per block")
            if ld.get("kv_transfers_sent") or ld.get("kv_transfers_received") or ld.get("kv_transfer_failures"):
                lines.append(f"  {'':<12} KV transfers: sent {ld['kv_transfers_sent']} ({ld['kv_bytes_sent'] / 1e6:.1f} "
                             f"MB), received {ld['kv_transfers_received']} ({ld['kv_bytes_received'] / 1e6:.1f} MB), "
                             f"{ld['kv_transfer_failures']} failed")
            if ld.get("prefix_pulls") or ld.get("prefix_pull_failures") or ld.get("prefix_pulls_served"):
                lines.append(f"  {'':<12} prefix pulls: {ld['prefix_pulls']} pulled ({ld['prefix_pull_blocks']} blocks, "
                             f"{ld['prefix_pull_bytes'] / 1e6:.1f} MB), {ld['prefix_pull_failures']} fell back to "
                             f"recompute, {ld['prefix_pulls_served']} served"
                             + (f" ({ld['prefix_pull_tier_blocks_served']} blocks from its KV tiers)"
                                if ld.get("prefix_pull_tier_blocks_served") else ""))
    return "\n".join(lines)


def _per_block_ms(seconds: float, blocks: int) -> str:
    """Mean time to load one block from a lower tier into the device ('-' before the first)."""
    return f"{seconds / blocks * 1e3:.2f} ms" if blocks else "-"
