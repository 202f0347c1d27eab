"""The live metrics provider (cluster/autoscale/metrics.py) over the router's real metric objects
(router/request_metrics.py, router/prometheus.py): windows from differenced readings, p90s from
histogram buckets as Prometheus computes them, several routers summed, the text format read back,
a failing source skipped, and no decision before there is a window."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.autoscale.loop import AutoscaleLoop
from cluster.autoscale.metrics import PrometheusWindows, histogram_quantile, read_pools
from protos.duet.worker.v1 import worker_pb2
from router.prometheus import metrics_registry
from router.request_metrics import RequestClock, RequestMetrics


def _router(queued: int = 0):
    """A router's exporter: request histograms + worker load reports (pool 'dec', one worker)."""
    m = RequestMetrics()
    report = worker_pb2.LoadReport(num_waiting=queued, num_running=2, kv_blocks_total=100, kv_blocks_used=25)
    snapshot = {"requests": {}, "admission": {"in_flight": 0, "queued": 0, "max_in_flight": 1, "max_queue": 1,
                                              "admitted": 0, "rejected": 0},
                "policy": {}, "workers": [], "worker_stream_failures": 0, "load_reports": [("dec-0", "dec", report)]}
    return m, metrics_registry(lambda: snapshot, m.registry)


def _serve(m: RequestMetrics, n: int, ttft: float, tpot: float, out: int = 11, prompt: int = 40) -> None:
    """n requests on pool 'dec', each with the given TTFT and TPOT (clock times, no sleeping)."""
    for _ in range(n):
        clock = RequestClock(received=0.0)
        m.routed(clock, "dec", "dec", prompt)
        m.chunk(clock, "dec", now=ttft)
        m.chunk(clock, "dec", now=ttft + tpot * (out - 1))
        m.finished_request(clock, "dec", out, "length", now=ttft + tpot * (out - 1))


def test_histogram_quantile_matches_prometheus():
    assert histogram_quantile(0.9, {0.05: 10, 0.1: 90, math.inf: 100}) == pytest.approx(0.1)
    assert histogram_quantile(0.5, {0.1: 0, 0.2: 100, math.inf: 100}) == pytest.approx(0.15)
    assert histogram_quantile(0.9, {0.1: 50, math.inf: 100}) == pytest.approx(0.1)  # in +Inf: largest finite bound
    assert histogram_quantile(0.9, {0.1: 0, math.inf: 0}) is None


def test_windows_from_differenced_readings():
    m, registry = _router(queued=4)
    provider = PrometheusWindows([registry.collect], window_buckets=4, latency_buckets=1)
    assert provider.windows(["dec"], now=0.0) == {}  # one reading: no window yet
    _serve(m, 20, ttft=0.2, tpot=0.03)
    w = provider.windows(["dec"], now=10.0)["dec"]
    assert w.arrivals_rps == [pytest.approx(2.0)] and w.bucket_s == 10.0
    assert (w.mean_prompt_tokens, w.mean_output_tokens, w.latency_samples) == (40.0, 11.0, 20)
    assert 0.15 <= w.ttft_p90_s <= 0.2 and 0.025 <= w.tpot_p90_s <= 0.03  # within the bucket holding the value
    assert (w.queue_depth, w.in_flight) == (4.0, 2.0)
    _serve(m, 5, ttft=1.8, tpot=0.09)
    w = provider.windows(["dec"], now=20.0)["dec"]
    assert w.arrivals_rps == [pytest.approx(2.0), pytest.approx(0.5)]
    assert 1.5 <= w.ttft_p90_s <= 2.0 and 0.075 <= w.tpot_p90_s <= 0.1  # the last bucket only (latency_buckets=1)
    assert w.latency_samples == 5
    for t in (30.0, 40.0, 50.0, 60.0):
        w = provider.windows(["dec"], now=t)["dec"]
    assert len(w.arrivals_rps) == 4 and w.arrivals_rps == [0.0] * 4 and w.ttft_p90_s is None
    assert w.mean_output_tokens == 0.0  # nothing finished within the window


def test_several_routers_sum_and_text_format_round_trips():
    (m1, r1), (m2, r2) = _router(queued=3), _router(queued=3)
    text_source = lambda: list(text_string_to_metric_families(generate_latest(r2).decode()))  # noqa: E731
    provider = PrometheusWindows([r1.collect, text_source], window_buckets=2, latency_buckets=1)
    provider.windows(["dec"], 0.0)
    _serve(m1, 6, ttft=0.2, tpot=0.03)
    _serve(m2, 4, ttft=0.2, tpot=0.03)
    w = provider.windows(["dec"], 2.0)["dec"]
    assert w.arrivals_rps == [pytest.approx(5.0)] and w.latency_samples == 10
    assert w.queue_depth == 3.0  # the workers' gauge seen by both routers: not double counted


def test_a_failing_source_is_skipped():
    m, registry = _router()

    def down():
        raise ConnectionError("router down")

    provider = PrometheusWindows([down, registry.collect], window_buckets=2, latency_buckets=1)
    provider.windows(["dec"], 0.0)
    _serve(m, 3, ttft=0.1, tpot=0.01)
    assert provider.windows(["dec"], 1.0)["dec"].arrivals_rps == [pytest.approx(3.0)]
    assert PrometheusWindows([down]).windows(["dec"], 0.0) == {}
    assert read_pools([]) == {}


def test_loop_holds_until_there_is_a_window():
    class Never:
        pools = ("dec",)

        def decide(self, now, metrics, status):
            raise AssertionError("decided without a window")

    class Actuator:
        def status(self, pool):
            from cluster.autoscale.actuator import PoolStatus
            return PoolStatus(pool, 1, 1, 0, 0)

        def scale_to(self, pool, replicas):
            raise AssertionError("scaled without a window")

    _, registry = _router()
    loop = AutoscaleLoop(Never(), PrometheusWindows([registry.collect]), Actuator(), interval_s=1.0)
    assert loop.step(now=0.0) == {} and loop.num_steps == 1


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="at least one metrics source"):
        PrometheusWindows([])
    with pytest.raises(ValueError, match="latency_buckets"):
        PrometheusWindows([lambda: []], window_buckets=2, latency_buckets=3)


def test_routers_differenced_apart_restart_join_and_miss_a_scrape():
    """sum(rate()) over routers: a router missing one scrape, restarting (counters back to 0) or joining
    neither dips nor inflates the summed arrival rate."""
    (m1, r1), (m2, r2) = _router(), _router()
    up = {"r2": True}
    routers = {"r1": r1}

    def source():
        return {name: list(reg.collect()) for name, reg in routers.items() if name != "r2" or up["r2"]}

    provider = PrometheusWindows([source], window_buckets=4, latency_buckets=1)
    provider.windows(["dec"], 0.0)
    _serve(m1, 10, ttft=0.2, tpot=0.03)
    routers["r2"] = r2  # joins with 50 requests already counted: its baseline, not an arrival burst
    _serve(m2, 50, ttft=0.2, tpot=0.03)
    assert provider.windows(["dec"], 1.0)["dec"].arrivals_rps == [pytest.approx(10.0)]
    _serve(m1, 4, ttft=0.2, tpot=0.03)
    _serve(m2, 6, ttft=0.2, tpot=0.03)
    assert provider.windows(["dec"], 2.0)["dec"].arrivals_rps[-1] == pytest.approx(10.0)
    up["r2"] = False  # one scrape of r2 fails: that step counts r1 alone, then r2's increase comes back
    _serve(m1, 5, ttft=0.2, tpot=0.03)
    assert provider.windows(["dec"], 3.0)["dec"].arrivals_rps[-1] == pytest.approx(5.0)
    up["r2"] = True
    m3, r3 = _router()  # r2 restarts: its counters start from zero again
    routers["r2"] = r3
    _serve(m3, 3, ttft=0.2, tpot=0.03)
    w = provider.windows(["dec"], 4.0)["dec"]
    assert w.arrivals_rps[-1] == pytest.approx(3.0)  # r2 against its reading at 2.0, reset: its 3 new ones
    _serve(m3, 2, ttft=0.2, tpot=0.03)
    _serve(m1, 1, ttft=0.2, tpot=0.03)
    w = provider.windows(["dec"], 5.0)["dec"]
    assert w.arrivals_rps == [pytest.approx(r) for r in (10.0, 5.0, 3.0, 3.0)]  # 21 arrivals, none lost or doubled
    assert w.latency_samples == 3 and w.mean_prompt_tokens == 40.0


def test_dns_source_reads_every_address_a_name_resolves_to(monkeypatch):
    """dns+http://: each address of the name is scraped as its own router (a headless Service)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cluster.autoscale.metrics import dns_source

    (m1, r1), (m2, r2) = _router(), _router()
    _serve(m1, 2, ttft=0.2, tpot=0.03)
    _serve(m2, 5, ttft=0.2, tpot=0.03)
    by_address = {"127.0.0.1": r1, "127.0.0.2": r2}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(by_address[self.server.server_address[0]])
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    first = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = first.server_address[1]
    try:
        second = ThreadingHTTPServer(("127.0.0.2", port), Handler)
    except OSError:
        first.server_close()
        pytest.skip("127.0.0.2 is not routable on this host's loopback")
    servers = [first, second]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    real = socket.getaddrinfo

    def resolve(host, *args, **kw):
        if host == "routers.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in by_address]
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    try:
        got = dns_source(f"dns+http://routers.test:{port}/metrics")()
        assert sorted(got) == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
        totals = read_pools(list(got.values()))["dec"].counters["arrived"]
        assert totals == 7.0
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
