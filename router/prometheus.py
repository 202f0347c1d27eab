"""The router's counters as Prometheus metrics over HTTP (``duet router --metrics-port``).

A collector reads ``RouterServer.stats()`` (the same snapshot ``duet status`` shows through
duet.control.v1.RouterAdmin) at scrape time, so nothing is counted twice and the request path pays
nothing. Exposed names (all prefixed ``duet_router_``):

    in_flight, queued, max_in_flight, max_queue                     gauges (admission control)
    workers{healthy="true"|"false"}                                 gauge: the router's view of its pool
    worker_in_flight{worker_id}, worker_load_tokens{worker_id}      gauges per worker
    requests_total, admitted_total, rejected_total, cancelled_total counters
    outcomes_total{outcome}                                         counter per request outcome / policy event
    worker_stream_failures_total, membership_version

Example::

    server = serve_metrics(9090, handle.stats)   # http://0.0.0.0:9090/metrics
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


def serve_metrics(port: int, snapshot: Callable[[], dict[str, Any]], host: str = "0.0.0.0") -> Any:
    """Serve /metrics on host:port from a private registry; returns the HTTP server
    (``.shutdown()`` then ``.server_close()`` stop it; ``.server_port`` is the bound port, useful
    with port 0)."""
    registry = CollectorRegistry()
    registry.register(RouterStatsCollector(snapshot))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    logger.info("router metrics on http://%s:%d/metrics", host, server.server_port)
    return server
