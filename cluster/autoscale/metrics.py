"""PrometheusWindows: the autoscaler's MetricsProvider over the routers' Prometheus metrics.

Each round (``windows(pools, now)``, called every ``interval_s`` by cluster/autoscale/loop.py) reads
the cumulative metrics the routers export (router/request_metrics.py, router/prometheus.py) from
one or more *sources* -- a router's registry in this process (``registry_source``) or its /metrics
URL (``http_source``) -- and keeps the last ``window_buckets`` + 1 readings. A pool's window is the
difference of consecutive readings:

    arrivals_rps[i]        increase of duet_requests_arrived_total{pool} between readings i, i+1 / dt
    mean_prompt_tokens     increase of duet_request_prompt_tokens _sum / _count over the window
    mean_output_tokens     the same for duet_request_output_tokens
    ttft_p90_s, tpot_p90_s histogram_quantile(0.9) of the bucket increases over the last
                           ``latency_buckets`` readings (None when nothing was observed)
    latency_samples        requests observed there (TPOT's count for decode pools, TTFT's otherwise)
    queue_depth, in_flight duet_requests_queued / duet_requests_running{pool}, mean of those readings

Drafting (cluster/autoscale/drafter.py's ``DraftWindow``, in ``PoolMetrics.draft``), from the
replicas' own reports the routers relay, labelled ``pool`` and ``worker_id`` / ``drafter_id``:

    duet_drafter_requests{pool}                  gauge     sum over replicas, mean over the
                                                           latency buckets -> rows
    duet_drafter_compute_seconds_total{pool}     counter   increase / window -> busy
    duet_worker_spec_{verifies, draft_tokens, accepted_tokens, emitted_tokens, draft_seconds,
                      verify_seconds}_total{pool}  counters increase over the window -> verifies ...
                                                           draft_wait_s, verify_s

Every router relays the same replica's report, so these are taken per replica as the largest
reading over sources (not the sum), then summed over the pool's replicas; a replica whose counter
went down restarted and counts from zero. A pool with none of these samples has ``draft`` None.

Several routers: each router is differenced on its own and the increases are summed (each router
counts its own requests), the way Prometheus' ``sum(rate(...))`` works: a router that restarted
(a counter went down) counts from zero, one that joined counts from its second reading, and one
that failed a scrape has its increase counted at its next reading -- no router's requests are
counted twice or lost when the set of routers changes. The per-pool gauges come from the workers' load reports, which every
router sees the same, so the largest reading is taken, not the sum. Until two readings exist there
is no window and ``windows`` returns nothing: the loop holds every pool (see AutoscaleLoop.step).

Controller restarts: ``snapshot`` / ``restore`` carry the readings over (cluster/autoscale/persist.py);
a router that kept running is then differenced across the restart's gap, and the first round
after it already has a window.

Sources: a registry (``registry_source``), one URL (``http_source``), or every address a DNS name
resolves to (``dns_source``, for ``dns+http://router-headless:9090/metrics``: a Kubernetes headless
Service resolves to each ready router pod, so N replicas behind one Service are all read, each
round, as they come and go; the Helm chart sets this).

histogram_quantile follows Prometheus': find the bucket where the cumulative count crosses
q x total and interpolate linearly inside it (from 0 for the first bucket); a quantile in the +Inf
bucket is the largest finite bound. Example: buckets le=0.05: 10, le=0.1: 90, +Inf: 100 ->
rank 90 -> inside (0.05, 0.1] at (90 - 10) / (90 - 10) -> 0.1.
"""

from __future__ import annotations

import logging
import math
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cluster.autoscale.drafter import DraftWindow
from cluster.autoscale.slo import PoolMetrics

logger = logging.getLogger(__name__)

# A source returns one router's metric families, or (dns_source) a mapping router address -> families.
Source = Callable[[], Iterable[Metric] | Mapping[str, Iterable[Metric]]]
DNS_SCHEME = "dns+"  # dns+http://name:port/path: every address ``name`` resolves to (dns_source)
_COUNTERS = {"duet_requests_arrived_total": "arrived",
             "duet_request_prompt_tokens_sum": "prompt_sum", "duet_request_prompt_tokens_count": "prompt_count",
             "duet_request_output_tokens_sum": "output_sum", "duet_request_output_tokens_count": "output_count"}
_HISTOGRAMS = {"duet_time_to_first_token_seconds_bucket": "ttft", "duet_time_per_output_token_seconds_bucket": "tpot"}
_GAUGES = {"duet_requests_queued": "queued", "duet_requests_running": "running"}
# Per-replica samples (max over sources, then summed over replicas): metric -> DraftWindow field.
_REPLICA_GAUGES = {"duet_drafter_requests": "rows"}
_REPLICA_COUNTERS = {"duet_drafter_compute_seconds_total": "busy",
                     "duet_worker_spec_verifies_total": "verifies",
                     "duet_worker_spec_draft_tokens_total": "draft_tokens",
                     "duet_worker_spec_accepted_tokens_total": "accepted_tokens",
                     "duet_worker_spec_emitted_tokens_total": "emitted_tokens",
                     "duet_worker_spec_draft_seconds_total": "draft_wait_s",
                     "duet_worker_spec_verify_seconds_total": "verify_s"}


@dataclass
class PoolReading:
    """One pool's cumulative numbers at one reading."""

    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count
    gauges: dict[str, float] = field(default_factory=dict)
    replicas: dict[tuple[str, str], float] = field(default_factory=dict)  # (DraftWindow field, replica) -> value

    def to_json(self) -> dict:
        return {"counters": self.counters, "gauges": self.gauges,
                "buckets": {h: [[str(le), v] for le, v in b.items()] for h, b in self.buckets.items()},
                "replicas": [[kind, replica, v] for (kind, replica), v in self.replicas.items()]}

    @classmethod
    def from_json(cls, d: Mapping) -> PoolReading:
        return cls(counters=dict(d["counters"]), gauges=dict(d["gauges"]),
                   buckets={h: {float(le): v for le, v in b} for h, b in d["buckets"].items()},
                   replicas={(kind, replica): v for kind, replica, v in d["replicas"]})


def registry_source(collect: Callable[[], Iterable[Metric]]) -> Source:
    """A source over an in-process registry's ``collect`` (e.g. router.prometheus.metrics_registry)."""
    return collect


def http_source(url: str, timeout_s: float = 5.0) -> Callable[[], Iterable[Metric]]:
    """A source scraping a Prometheus text endpoint, e.g. http://router:9090/metrics."""
    def scrape() -> Iterable[Metric]:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # an operator-given URL
            return list(text_string_to_metric_families(response.read().decode()))
    return scrape


def dns_source(url: str, timeout_s: float = 5.0) -> Source:
    """A source over every address ``url``'s host resolves to, read afresh each round:
    ``dns+http://duet-router-headless:9090/metrics`` scrapes http://<each pod IP>:9090/metrics. An
    address that fails is skipped for the round (logged); no address at all fails the source."""
    import socket
    from urllib.parse import urlsplit

    assert url.startswith(DNS_SCHEME), url
    parts = urlsplit(url[len(DNS_SCHEME):])
    if not parts.hostname or not parts.port:
        raise ValueError(f"{url!r}: needs a host and a port, e.g. dns+http://router-headless:9090/metrics")
    host, port, path = parts.hostname, parts.port, parts.path or "/metrics"

    def scrape() -> dict[str, Iterable[Metric]]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = sorted({str(info[4][0]) for info in infos})
        out: dict[str, Iterable[Metric]] = {}
        for address in addresses:
            shown = f"[{address}]" if ":" in address else address
            try:
                out[f"{shown}:{port}"] = http_source(f"{parts.scheme}://{shown}:{port}{path}", timeout_s)()
            except Exception as e:  # noqa: BLE001 - one router down must not hide the others
                logger.warning("autoscaler metrics: %s (%s of %s) failed (%s: %s); skipping it this round",
                               address, host, url, type(e).__name__, e)
        if not out:
            raise ConnectionError(f"no router of {url} answered ({len(addresses)} addresses)")
        return out
    return scrape


def source_for(url: str) -> Source:
    """``dns_source`` for a dns+http(s):// URL, else ``http_source``."""
    return dns_source(url) if url.startswith(DNS_SCHEME) else http_source(url)


def read_pools(families_per_source: Sequence[Iterable[Metric]]) -> dict[str, PoolReading]:
    """Fold every source's samples into one PoolReading per ``pool`` label."""
    pools: dict[str, PoolReading] = {}
    for families in families_per_source:
        for family in families:
            for sample in family.samples:
                pool = sample.labels.get("pool")
                if pool is None:
                    continue
                r = pools.setdefault(pool, PoolReading())
                if sample.name in _COUNTERS:
                    key = _COUNTERS[sample.name]
                    r.counters[key] = r.counters.get(key, 0.0) + sample.value
                elif sample.name in _HISTOGRAMS:
                    le = float(sample.labels["le"])
                    b = r.buckets.setdefault(_HISTOGRAMS[sample.name], {})
                    b[le] = b.get(le, 0.0) + sample.value
                elif sample.name in _GAUGES:
                    key = _GAUGES[sample.name]
                    r.gauges[key] = max(r.gauges.get(key, 0.0), sample.value)
                elif sample.name in _REPLICA_GAUGES or sample.name in _REPLICA_COUNTERS:
                    replica = sample.labels.get("drafter_id") or sample.labels.get("worker_id", "")
                    key2 = (_REPLICA_GAUGES.get(sample.name) or _REPLICA_COUNTERS[sample.name], replica)
                    r.replicas[key2] = max(r.replicas.get(key2, 0.0), sample.value)
    return pools


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative ``{le: count}`` (module docstring); None if empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower if lower > 0 else None
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


class PrometheusWindows:
    """MetricsProvider (cluster/autoscale/loop.py) over ``sources``; see the module docstring."""

    def __init__(self, sources: Sequence[Source], *, window_buckets: int = 30, latency_buckets: int = 3) -> None:
        if not sources:
            raise ValueError("PrometheusWindows needs at least one metrics source (a router)")
        if window_buckets < 1 or not 1 <= latency_buckets <= window_buckets:
            raise ValueError(f"window_buckets={window_buckets}, latency_buckets={latency_buckets}: need "
                             "1 <= latency_buckets <= window_buckets")
        self.sources = list(sources)
        self.window_buckets, self.latency_buckets = window_buckets, latency_buckets
        # (time, router -> pool -> reading), oldest first
        self.readings: deque[tuple[float, dict[str, dict[str, PoolReading]]]] = deque(maxlen=window_buckets + 1)

    def snapshot(self, now: float) -> dict:
        """The readings, each at its age at ``now`` (cluster/autoscale/persist.py)."""
        return {"readings": [[now - t, {router: {pool: r.to_json() for pool, r in pools.items()}
                                         for router, pools in read.items()}] for t, read in self.readings]}

    def restore(self, data: Mapping, saved_at: float, now: float) -> None:
        """Readings saved by ``snapshot`` (``saved_at``: the save's moment on this clock), unless the
        gap from the last one to ``now`` is longer than the window they span: the first step after
        the restart would then be most of the window, and its rate an average over the outage."""
        saved = [(saved_at - age_s, {router: {pool: PoolReading.from_json(r) for pool, r in pools.items()}
                                for router, pools in read.items()}) for age_s, read in data.get("readings", [])]
        if not saved:
            return
        gap, span = now - saved[-1][0], saved[-1][0] - saved[0][0]
        if gap > span:
            logger.info("autoscaler metrics: not restoring %d readings (%.0f s since the last one, the window "
                        "spans %.0f s)", len(saved), gap, span)
            return
        self.readings.clear()
        self.readings.extend(saved)

    def windows(self, pools: Sequence[str], now: float) -> dict[str, PoolMetrics]:
        read: dict[str, dict[str, PoolReading]] = {}  # router -> pool -> reading
        for i, source in enumerate(self.sources):
            try:
                got = source()
            except Exception as e:  # noqa: BLE001 - one router down must not stop scaling on the others
                logger.warning("autoscaler metrics: a source failed (%s: %s); skipping it this round",
                               type(e).__name__, e)
                continue
            routers = got if isinstance(got, Mapping) else {f"#{i}": got}
            for key, families in routers.items():
                read[f"{i}/{key}"] = read_pools([list(families)])
        if not read:
            return {}
        self.readings.append((now, read))
        if len(self.readings) < 2:
            return {}
        return {pool: self._window(pool) for pool in pools}

    def _steps(self, pool: str) -> list[tuple[float, PoolReading, list[PoolReading]]]:
        """Per step between consecutive readings: its seconds, the increase summed over the routers
        read at its end (each since its previous reading in the window, so a missed scrape loses
        nothing; counter resets count from zero), and the routers' readings at its end."""
        steps = []
        last = dict(self.readings[0][1])  # router -> its latest reading so far (a missed scrape is bridged)
        for (t0, _), (t1, b) in zip(self.readings, list(self.readings)[1:]):
            inc = PoolReading()
            for key, now in b.items():
                before = last.get(key)
                last[key] = now
                if before is None:
                    continue  # a router's first reading: its baseline
                new, old = now.get(pool, PoolReading()), before.get(pool, PoolReading())
                reset = any(v < old.counters.get(k, 0.0) for k, v in new.counters.items())
                for k, v in new.counters.items():
                    inc.counters[k] = inc.counters.get(k, 0.0) + (v if reset else v - old.counters.get(k, 0.0))
                for h, buckets in new.buckets.items():
                    prev = old.buckets.get(h, {})
                    h_reset = reset or any(v < prev.get(le, 0.0) for le, v in buckets.items())
                    acc = inc.buckets.setdefault(h, {})
                    for le, v in buckets.items():
                        acc[le] = acc.get(le, 0.0) + (v if h_reset else v - prev.get(le, 0.0))
            steps.append((t1 - t0, inc, [r.get(pool, PoolReading()) for r in b.values()]))
        return steps

    def _window(self, pool: str) -> PoolMetrics:
        steps = self._steps(pool)
        rates = [inc.counters.get("arrived", 0.0) / dt if dt > 0 else 0.0 for dt, inc, _ in steps]

        def total(key: str) -> float:
            return sum(inc.counters.get(key, 0.0) for _, inc, _ in steps)

        def mean(kind: str) -> float:
            n = total(f"{kind}_count")
            return total(f"{kind}_sum") / n if n > 0 else 0.0

        def latency(h: str) -> dict[float, float]:
            acc: dict[float, float] = {}
            for _, inc, _ in steps[-self.latency_buckets:]:
                for le, v in inc.buckets.get(h, {}).items():
                    acc[le] = acc.get(le, 0.0) + v
            return acc

        def gauge(key: str) -> float:
            recent = [max((r.gauges.get(key, 0.0) for r in routers), default=0.0)
                      for _, _, routers in steps[-self.latency_buckets:]]
            return sum(recent) / len(recent)

        merged = [_replica_reading(reading, pool) for _, reading in self.readings]
        first_r, last_r, recent_r = merged[0], merged[-1], merged[-self.latency_buckets:]
        ttft, tpot = latency("ttft"), latency("tpot")
        n_ttft, n_tpot = max(ttft.values(), default=0.0), max(tpot.values(), default=0.0)
        t_first, t_last = self.readings[0][0], self.readings[-1][0]
        return PoolMetrics(
            bucket_s=(t_last - t_first) / len(steps), arrivals_rps=rates,
            mean_prompt_tokens=mean("prompt"), mean_output_tokens=mean("output"),
            ttft_p90_s=histogram_quantile(0.9, ttft), tpot_p90_s=histogram_quantile(0.9, tpot),
            latency_samples=int(n_tpot if n_tpot > 0 else n_ttft),
            queue_depth=gauge("queued"), in_flight=gauge("running"),
            draft=_draft_window(first_r, last_r, recent_r, t_last - t_first))


def _replica_reading(reading: Mapping[str, Mapping[str, PoolReading]], pool: str) -> PoolReading:
    """One reading's per-replica drafting samples of ``pool``, the largest over routers (every router
    relays the same replica's report)."""
    out = PoolReading()
    for pools in reading.values():
        for key, v in pools.get(pool, PoolReading()).replicas.items():
            out.replicas[key] = max(out.replicas.get(key, 0.0), v)
    return out


def _draft_window(first: PoolReading, last: PoolReading, recent: Sequence[PoolReading], span_s: float) -> DraftWindow | None:
    """The pool's DraftWindow (module docstring), or None when it reported no drafting samples."""
    if not any(r.replicas for r in (first, last, *recent)):
        return None
    inc: dict[str, float] = {}
    for (kind, replica), v in last.replicas.items():
        if kind in _REPLICA_GAUGES.values():
            continue
        before = first.replicas.get((kind, replica), 0.0)
        inc[kind] = inc.get(kind, 0.0) + (v - before if v >= before else v)  # went down: restarted, from 0
    rows = sum(sum(v for (kind, _), v in r.replicas.items() if kind == "rows") for r in recent) / len(recent)
    busy = inc.pop("busy", 0.0) / span_s if span_s > 0 else 0.0
    return DraftWindow(rows=rows, busy=busy, **inc)
