"""The router's counters as Prometheus metrics over HTTP: ``GET /metrics`` on the router's HTTP API
port (router/http_api/), or a plain metrics server (``duet router --metrics-port``).

A collector reads ``RouterServer.stats()`` (the same snapshot ``duet status`` shows through
duet.control.v1.RouterAdmin) at scrape time, so nothing is counted twice and the request path pays
nothing. Exposed names (all prefixed ``duet_router_``):

    in_flight, queued, max_in_flight, max_queue                     gauges (admission control)
    workers{healthy="true"|"false"}                                 gauge: the router's view of its pool
    worker_in_flight{worker_id}, worker_load_tokens{worker_id}      gauges per worker
    requests_total, admitted_total, rejected_total, cancelled_total counters
    outcomes_total{outcome}                                         counter per request outcome / policy event
    worker_stream_failures_total, membership_version
    held                                                            gauge: requests held for a worker (router/hold.py)
    held_requests_total, hold_timed_out_total, wakes_total,         counters: holding requests, waking pools
    pools_woken_total                                               from zero

Per pool (label ``pool``), observed on the request path by router/request_metrics.py (TTFT, TPOT,
ITL and E2E histograms, arrivals, prompt/output lengths; see there) and, from the workers' latest
load reports (the router polls every worker's GetLoad anyway, so the workers need no HTTP server of
their own and a scrape costs them nothing), ``WorkerLoadCollector``:

    duet_requests_queued{pool}, duet_requests_running{pool}     gauges: sums over the pool's workers
    duet_kv_block_usage_ratio{pool}                             gauge: KV blocks held / total
    duet_worker_<gauge>{pool,worker_id}                         requests_running, requests_waiting,
                                                                outstanding_tokens, kv_blocks_{used,total,cached}
    duet_worker_<counter>_total{pool,worker_id}                 prefix cache queries/hits, preemptions,
                                                                KV transfers, bytes, failures, seconds
    duet_worker_expert_tokens_total{pool,worker_id,expert}      MoE: token-expert assignments per expert
    duet_worker_ep_rank_tokens_total{pool,worker_id,rank}       MoE: tokens computed per expert-parallel rank

Example::

    server = serve_metrics(9090, handle.stats, handle.server.metrics.registry)   # http://0.0.0.0:9090/metrics
    server.shutdown(); server.server_close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

PREFIX = "duet_router_"


class RouterStatsCollector:
    """A prometheus_client custom collector over a router stats snapshot function."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        adm, req = s["admission"], dict(s["requests"])
        for name in ("in_flight", "queued", "max_in_flight", "max_queue"):
            yield GaugeMetricFamily(PREFIX + name, f"router admission: {name.replace('_', ' ')}", value=adm[name])
        workers = s["workers"]
        by_health = GaugeMetricFamily(PREFIX + "workers", "workers the router knows, by health", labels=["healthy"])
        for healthy in (True, False):
            by_health.add_metric([str(healthy).lower()], sum(bool(w["healthy"]) == healthy for w in workers))
        yield by_health
        in_flight = GaugeMetricFamily(PREFIX + "worker_in_flight", "streams open to each worker", labels=["worker_id"])
        load = GaugeMetricFamily(PREFIX + "worker_load_tokens", "each worker's last reported load in tokens",
                                 labels=["worker_id"])
        for w in workers:
            in_flight.add_metric([w["worker_id"]], w["in_flight"])
            load.add_metric([w["worker_id"]], w["load_tokens"])
        yield in_flight
        yield load
        yield CounterMetricFamily(PREFIX + "requests", "requests received", value=req.get("requests", 0))
        yield CounterMetricFamily(PREFIX + "admitted", "requests admitted", value=adm["admitted"])
        yield CounterMetricFamily(PREFIX + "rejected", "requests rejected by admission control", value=adm["rejected"])
        yield CounterMetricFamily(PREFIX + "cancelled", "requests cancelled by the client", value=req.get("cancelled", 0))
        outcomes = CounterMetricFamily(PREFIX + "outcomes", "request outcomes and routing-policy events",
                                       labels=["outcome"])
        for key, value in sorted(req.items()):
            if key not in ("requests", "cancelled"):
                outcomes.add_metric([key], value)
        for key, value in sorted(s["policy"].items()):
            outcomes.add_metric([f"policy_{key}"], value)
        yield outcomes
        yield CounterMetricFamily(PREFIX + "worker_stream_failures", "worker streams that failed",
                                  value=s["worker_stream_failures"])
        yield GaugeMetricFamily(PREFIX + "membership_version", "version of the member list last applied",
                                value=s.get("membership_version", 0))
        hold = s.get("hold", {})
        yield GaugeMetricFamily(PREFIX + "held", "requests held until a worker can take them (a pool waking from "
                                "zero, workers restarting)", value=hold.get("held", 0))
        for name, key, help_ in (("held_requests", "held_total", "requests that were held"),
                                 ("hold_timed_out", "hold_timed_out", "held requests that gave up"),
                                 ("wakes", "wakes", "wake requests sent to the controller"),
                                 ("pools_woken", "pools_woken", "pools the controller woke from zero for this router")):
            yield CounterMetricFamily(PREFIX + name, help_, value=hold.get(key, 0))


# LoadReport gauges and counters exported per worker: (LoadReport field, metric name, help).
WORKER_GAUGES = (
    ("num_running", "requests_running", "requests the worker is running"),
    ("num_waiting", "requests_waiting", "requests queued on the worker, not yet scheduled"),
    ("outstanding_tokens", "outstanding_tokens", "token positions still to compute for its requests"),
    ("kv_blocks_used", "kv_blocks_used", "KV blocks held by requests"),
    ("kv_blocks_total", "kv_blocks_total", "KV blocks of the worker's cache"),
    ("kv_blocks_cached", "kv_blocks_cached", "KV blocks holding a prefix-cache entry"),
    ("draining", "draining", "1 while the worker drains (takes no new requests, migrates its running ones)"),
    ("tier_host_bytes", "kv_tier_host_bytes", "KV bytes held in the worker's host-memory tier"),
    ("tier_disk_bytes", "kv_tier_disk_bytes", "KV bytes held in the worker's local-disk tier"),
)
WORKER_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "prompt blocks looked up in the prefix cache"),
    ("prefix_cache_hits", "prefix_cache_hits", "prompt blocks found in the prefix cache"),
    ("num_preemptions", "preemptions", "requests preempted (KV freed, recomputed later)"),
    ("kv_transfers_sent", "kv_transfers_sent", "KV transfers sent (prefill side)"),
    ("kv_transfers_received", "kv_transfers_received", "KV transfers received and verified (decode side)"),
    ("kv_bytes_sent", "kv_sent_bytes", "KV bytes sent"),
    ("kv_bytes_received", "kv_received_bytes", "KV bytes received"),
    ("kv_transfer_failures", "kv_transfer_failures", "failed KV transfers"),
    ("kv_transfer_seconds", "kv_transfer_seconds", "wall time spent in KV transfers"),
    # live migration (workers/handoff/migration_service.py)
    ("migrations_out", "migrations_out", "running requests migrated to another worker (confirmed by the target)"),
    ("migrations_in", "migrations_in", "running requests taken over from another worker"),
    ("migration_failures", "migration_failures", "migrations that failed (the request stayed where it was)"),
    ("migration_kv_bytes", "migration_kv_bytes", "KV bytes moved by migrations (sent + received)"),
    ("migration_seconds", "migration_seconds", "seconds from pause to confirmation of outgoing migrations"),
    ("prefix_pulls", "prefix_pulls", "prompt prefixes pulled from another worker instead of recomputed"),
    ("prefix_pull_blocks", "prefix_pull_blocks", "KV blocks pulled for prompt prefixes"),
    ("prefix_pull_bytes", "prefix_pull_bytes", "KV bytes pulled for prompt prefixes"),
    ("prefix_pull_failures", "prefix_pull_failures", "prefix pulls that failed (the prompt was computed instead)"),
    ("prefix_pulls_served", "prefix_pulls_served", "prefix pulls this worker served as the holder"),
    ("prefix_pull_tier_blocks_served", "prefix_pull_tier_blocks_served",
     "KV blocks of served prefix pulls read from this worker's lower tiers (host, disk)"),
    # lower KV tiers (workers/engine/kv_tiers.py); all 0 when cache.host_tier_bytes is 0. Load latency per
    # block = rate(..._kv_tier_load_seconds_total) / rate(..._kv_tier_host_hits_total). Where the router sent
    # prefix hits, by the tier the worker held them in: duet_router_outcomes_total{outcome=
    # "policy_matched_{device,host,disk}_blocks"} (router/policies/prefix_aware.py)
    ("tier_host_hits", "kv_tier_host_hits", "KV blocks loaded back into the device from the host tier"),
    ("tier_disk_hits", "kv_tier_disk_hits", "KV blocks read back from the disk tier into host"),
    ("tier_bytes_to_host", "kv_tier_to_host_bytes", "KV bytes evicted from the device into the host tier"),
    ("tier_bytes_to_disk", "kv_tier_to_disk_bytes", "KV bytes spilled from the host tier to disk"),
    ("tier_bytes_loaded", "kv_tier_loaded_bytes", "KV bytes loaded from the host tier into the device"),
    ("tier_host_evictions", "kv_tier_host_evictions", "KV blocks evicted out of the host tier (to disk or dropped)"),
    ("tier_disk_evictions", "kv_tier_disk_evictions", "KV blocks evicted out of the disk tier (deleted)"),
    ("tier_refused_corrupt", "kv_tier_refused_corrupt", "tier KV blocks refused for a checksum, size or digest "
     "mismatch (recomputed)"),
    ("tier_refused_foreign", "kv_tier_refused_foreign", "tier KV blocks refused as another model's (recomputed)"),
    ("tier_deadline_misses", "kv_tier_deadline_misses", "requests whose disk KV reads missed the deadline "
     "(recomputed)"),
    ("tier_load_seconds", "kv_tier_load_seconds", "seconds spent loading tier KV blocks into the device"),
)
# ---- speculative decoding (workers/engine/speculator.py) -----------------------------------
# acceptance rate = rate(duet_worker_spec_accepted_tokens_total) / rate(..._spec_draft_tokens_total);
# tokens per verify = rate(..._spec_emitted_tokens_total) / rate(..._spec_verifies_total). All stay 0
# on workers without speculation.
SPEC_DECODE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("spec_verifies", "spec_verifies", "requests' draft windows verified in one target pass"),
    ("spec_draft_tokens", "spec_draft_tokens", "draft tokens proposed and verified"),
    ("spec_accepted_tokens", "spec_accepted_tokens", "draft tokens the target accepted"),
    ("spec_emitted_tokens", "spec_emitted_tokens", "tokens appended by verifies (accepted + the target's own)"),
    ("spec_draft_seconds", "spec_draft_seconds", "seconds the worker waited for drafts"),
    ("spec_verify_seconds", "spec_verify_seconds", "seconds of target steps that verified drafts"),
    ("spec_fallbacks", "spec_fallbacks", "requests that went without drafts because the drafter failed"),
)


# ---- drafter replicas (workers/spec_decode/drafter_service.py DrafterLoad) ----------------------
# mean batch = rate(duet_drafter_batched_rows_total) / rate(duet_drafter_forward_passes_total).
DRAFTER_GAUGES = (
    ("num_requests", "requests", "requests holding drafter state"),
    ("num_active", "active_requests", "requests drafting now"),
    ("num_streams", "streams", "open Rounds streams (targets)"),
    ("kv_blocks_used", "kv_blocks_used", "drafter KV blocks held"),
    ("kv_blocks_total", "kv_blocks_total", "drafter KV blocks"),
)
DRAFTER_COUNTERS = (
    ("rounds", "rounds", "draft rounds served"),
    ("draft_tokens", "draft_tokens", "draft tokens produced"),
    ("forward_passes", "forward_passes", "batched forward passes"),
    ("batched_rows", "batched_rows", "requests summed over forward passes"),
    ("tokens_computed", "tokens_computed", "tokens run through the draft model"),
    ("compute_seconds", "compute_seconds", "seconds the draft engine computed"),
    ("evictions", "evictions", "requests whose KV was evicted under pressure (re-prefilled later)"),
    ("expired", "expired", "requests freed after the idle timeout"),
    ("releases", "releases", "requests released by their target"),
    ("resyncs", "resyncs", "items answered resync (the target resent the whole context)"),
)


class DrafterLoadCollector:
    """The drafter replicas' latest DrafterLoad (router.drafters.DrafterDirectory.load_reports)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        reports = self._snapshot().get("drafter_reports", [])
        labels = ["pool", "drafter_id"]
        for kind, fields in ((GaugeMetricFamily, DRAFTER_GAUGES), (CounterMetricFamily, DRAFTER_COUNTERS)):
            for field, name, help_ in fields:
                family = kind(f"duet_drafter_{name}", help_, labels=labels)
                for drafter_id, pool, r in reports:
                    family.add_metric([pool, drafter_id], getattr(r, field))
                yield family


class WorkerLoadCollector:
    """The workers' latest load reports, per worker and summed per pool. ``reports`` returns
    (worker_id, pool, LoadReport) triples (WorkerDirectory.load_reports, read on the router's loop)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        reports = self._snapshot().get("load_reports", [])
        yield from self._per_pool(reports)
        labels = ["pool", "worker_id"]
        for field, name, help_ in WORKER_GAUGES:
            family = GaugeMetricFamily(f"duet_worker_{name}", help_, labels=labels)
            for worker_id, pool, r in reports:
                family.add_metric([pool, worker_id], getattr(r, field))
            yield family
        for field, name, help_ in WORKER_COUNTERS + SPEC_DECODE_COUNTERS:
            counter = CounterMetricFamily(f"duet_worker_{name}", help_, labels=labels)
            for worker_id, pool, r in reports:
                counter.add_metric([pool, worker_id], getattr(r, field))
            yield counter
        for field, label in (("expert_tokens", "expert"), ("ep_rank_tokens", "rank")):
            counter = CounterMetricFamily(f"duet_worker_{field}", f"MoE: {field.replace('_', ' ')} per {label}",
                                          labels=[*labels, label])
            for worker_id, pool, r in reports:
                for i, value in enumerate(getattr(r, field)):
                    counter.add_metric([pool, worker_id, str(i)], value)
            yield counter

    @staticmethod
    def _per_pool(reports: list[tuple[str, str, Any]]) -> Iterator[Metric]:
        pools: dict[str, list[Any]] = {}
        for _, pool, r in reports:
            pools.setdefault(pool, []).append(r)
        queued = GaugeMetricFamily("duet_requests_queued", "requests queued on the pool's workers", labels=["pool"])
        running = GaugeMetricFamily("duet_requests_running", "requests running on the pool's workers", labels=["pool"])
        kv = GaugeMetricFamily("duet_kv_block_usage_ratio", "KV blocks held / total over the pool", labels=["pool"])
        for pool, rs in sorted(pools.items()):
            queued.add_metric([pool], sum(r.num_waiting for r in rs))
            running.add_metric([pool], sum(r.num_running for r in rs))
            total = sum(r.kv_blocks_total for r in rs)
            kv.add_metric([pool], sum(r.kv_blocks_used for r in rs) / total if total else 0.0)
        yield from (queued, running, kv)


class _RegistryCollector:
    """Re-exports another registry's metrics (the router's request histograms) from this one."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()


class _LabelledCollector:
    """Another collector's metrics with one more label on every sample (vLLM's ``model_name``), so
    dashboards built for vLLM select Duet's series the same way: a sample of a pool (label
    ``pool``) gets the model that pool serves (``by_pool()``: pool -> model), any other the
    default ``value``."""

    def __init__(self, inner: Any, name: str, value: str,
                 by_pool: Callable[[], dict[str, str]] | None = None) -> None:
        self._inner = inner
        self._name = name
        self._value = value
        self._by_pool = by_pool

    def collect(self) -> Iterator[Metric]:
        pools = self._by_pool() if self._by_pool is not None else {}
        for family in self._inner.collect():
            family.samples = [s._replace(labels={**s.labels, self._name: pools.get(s.labels.get("pool", ""),
                                                                                   self._value)})
                              for s in family.samples]
            yield family


def metrics_registry(snapshot: Callable[[], dict[str, Any]], request_metrics: CollectorRegistry | None = None,
                     model_name: str | None = None) -> CollectorRegistry:
    """A registry with everything a router exports: its counters, the workers' load, and (given
    the router's ``RequestMetrics.registry``) the per-pool request histograms; with
    ``model_name`` (the default model), every sample also carries the label ``model_name``: the
    model of its pool (the workers' members say it, with several models), else ``model_name``."""
    collectors: list[Any] = [RouterStatsCollector(snapshot), WorkerLoadCollector(snapshot), DrafterLoadCollector(snapshot)]
    if request_metrics is not None:
        collectors.append(_RegistryCollector(request_metrics))
    registry = CollectorRegistry()

    def by_pool() -> dict[str, str]:
        assert model_name is not None
        return {str(w["pool"]): str(w.get("model") or model_name) for w in snapshot().get("workers", ())
                if w.get("pool")}
    for c in collectors:
        registry.register(c if model_name is None else _LabelledCollector(c, "model_name", model_name, by_pool))
    return registry


def serve_metrics(port: int, snapshot: Callable[[], dict[str, Any]], request_metrics: CollectorRegistry | None = None,
                  host: str = "0.0.0.0", model_name: str | None = None) -> Any:
    """Serve /metrics on host:port (see ``metrics_registry``); returns the HTTP server
    (``.shutdown()`` then ``.server_close()`` stop it; ``.server_port`` is the bound port, useful
    with port 0)."""
    registry = metrics_registry(snapshot, request_metrics, model_name)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    logger.info("router metrics on http://%s:%d/metrics", host, server.server_port)
    return server
