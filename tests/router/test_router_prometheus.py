"""router/prometheus.py: the router's stats snapshot as Prometheus text, read at scrape time."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from router.prometheus import RouterStatsCollector, serve_metrics


def _snapshot() -> dict:
    return {"requests": {"requests": 7, "cancelled": 1, "finish_stop": 4, "finish_length": 2},
            "admission": {"in_flight": 3, "queued": 1, "max_in_flight": 128, "max_queue": 512, "admitted": 6,
                          "rejected": 1, "admitted_after_queueing": 2},
            "policy_name": "prefix_aware", "policy": {"prefix_hits": 5},
            "workers": [{"worker_id": "default-0", "endpoint": "10.0.0.5:40001", "healthy": True, "in_flight": 2,
                         "load_tokens": 300, "last_error": None},
                        {"worker_id": "default-1", "endpoint": "10.0.0.6:40001", "healthy": False, "in_flight": 0,
                         "load_tokens": 0, "last_error": "UNAVAILABLE"}],
            "worker_stream_failures": 1, "membership_version": 3}


def test_collector_exposes_the_snapshot():
    registry = CollectorRegistry()
    registry.register(RouterStatsCollector(_snapshot))
    text = generate_latest(registry).decode()
    for line in ("duet_router_in_flight 3.0", "duet_router_queued 1.0", "duet_router_requests_total 7.0",
                 "duet_router_admitted_total 6.0", "duet_router_rejected_total 1.0", "duet_router_cancelled_total 1.0",
                 'duet_router_workers{healthy="true"} 1.0', 'duet_router_workers{healthy="false"} 1.0',
                 'duet_router_worker_load_tokens{worker_id="default-0"} 300.0',
                 'duet_router_outcomes_total{outcome="finish_stop"} 4.0',
                 'duet_router_outcomes_total{outcome="policy_prefix_hits"} 5.0',
                 "duet_router_worker_stream_failures_total 1.0", "duet_router_membership_version 3.0"):
        assert line in text, f"{line!r} missing from:\n{text}"


def test_serve_metrics_reads_fresh_values_per_scrape():
    snap = _snapshot()
    server = serve_metrics(0, lambda: snap, host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert "duet_router_requests_total 7.0" in urllib.request.urlopen(url, timeout=5).read().decode()
        snap["requests"]["requests"] = 8
        assert "duet_router_requests_total 8.0" in urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_worker_spec_decode_counters_are_exported():
    """The workers' speculative-decoding counters (LoadReport) become per-worker Prometheus counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    from protos.duet.worker.v1 import worker_pb2
    from router.prometheus import WorkerLoadCollector

    report = worker_pb2.LoadReport(worker_id="w0", spec_method="ngram", spec_verifies=10, spec_draft_tokens=40,
                                   spec_accepted_tokens=25, spec_emitted_tokens=35, spec_fallbacks=2)
    registry = CollectorRegistry()
    registry.register(WorkerLoadCollector(lambda: {"load_reports": [("w0", "dec", report)]}))
    text = generate_latest(registry).decode()
    for line in ('duet_worker_spec_draft_tokens_total{pool="dec",worker_id="w0"} 40.0',
                 'duet_worker_spec_accepted_tokens_total{pool="dec",worker_id="w0"} 25.0',
                 'duet_worker_spec_emitted_tokens_total{pool="dec",worker_id="w0"} 35.0',
                 'duet_worker_spec_verifies_total{pool="dec",worker_id="w0"} 10.0',
                 'duet_worker_spec_fallbacks_total{pool="dec",worker_id="w0"} 2.0'):
        assert line in text, f"{line!r} missing from:\n{text}"


def test_worker_migration_counters_are_exported():
    """Live migration counters (LoadReport) become per-worker Prometheus counters; draining a gauge."""
    from prometheus_client import CollectorRegistry, generate_latest

    from protos.duet.worker.v1 import worker_pb2
    from router.prometheus import WorkerLoadCollector

    report = worker_pb2.LoadReport(worker_id="w0", migrations_out=3, migrations_in=1, migration_failures=2,
                                   migration_kv_bytes=4096, migration_seconds=0.5, draining=True)
    registry = CollectorRegistry()
    registry.register(WorkerLoadCollector(lambda: {"load_reports": [("w0", "dec", report)]}))
    text = generate_latest(registry).decode()
    for line in ('duet_worker_migrations_out_total{pool="dec",worker_id="w0"} 3.0',
                 'duet_worker_migrations_in_total{pool="dec",worker_id="w0"} 1.0',
                 'duet_worker_migration_failures_total{pool="dec",worker_id="w0"} 2.0',
                 'duet_worker_migration_kv_bytes_total{pool="dec",worker_id="w0"} 4096.0',
                 'duet_worker_migration_seconds_total{pool="dec",worker_id="w0"} 0.5',
                 'duet_worker_draining{pool="dec",worker_id="w0"} 1.0'):
        assert line in text, f"{line!r} missing from:\n{text}"
