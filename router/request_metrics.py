"""Per-pool serving metrics, as Prometheus histograms and counters the router observes on the request path.

Every metric carries the label ``pool`` (the pool of the worker that did that part of the work: a
disaggregated request's TTFT and prompt belong to its prefill pool, everything after the first
token to its decode pool; a colocated request is one pool's throughout). Definitions follow the
common ones (ARCHITECTURE.md, cluster/bench/metrics.py):

    duet_requests_arrived_total{pool}              counter    requests routed to the pool (first route; a
                                                              retry or a resume is not a new arrival)
    duet_request_prompt_tokens{pool}               histogram  prompt tokens per arrival (its _sum / _count:
                                                              the mean prompt, what the autoscaler reads)
    duet_request_output_tokens{pool}               histogram  completion tokens per finished request
    duet_time_to_first_token_seconds{pool}         histogram  router receipt -> first token streamed
    duet_time_per_output_token_seconds{pool}       histogram  (E2E - TTFT) / (n - 1), requests with n >= 2
    duet_inter_token_latency_seconds{pool}         histogram  gap between streamed chunks
    duet_e2e_request_latency_seconds{pool}         histogram  router receipt -> last token
    duet_requests_finished_total{pool,finish_reason}  counter finished requests by finish reason
    duet_wake_seconds{pool}                        histogram  a request held while its pool woke from zero
                                                              replicas: held -> a worker taken (router/hold.py)

The router measures from when it receives a request, so TTFT includes tokenization, admission
queueing and routing: what a client sees, minus the network. Only requests that finish are
observed for E2E/TPOT/output (a failed request counts in the router's outcome counters instead).

Worked example: a request with a 40-token prompt arrives at t=0, its first token streams at
0.30 s and its 17th (last) at 1.10 s on pool "decode" -> arrived{decode} += 1,
prompt_tokens{decode}.observe(40), ttft{decode}.observe(0.30), tpot{decode}.observe(0.05),
e2e{decode}.observe(1.10), output_tokens{decode}.observe(17).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

# Buckets: dense around typical CPU/GPU SLOs so a p90 interpolated from them is within one bucket's width.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15,
                0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class RequestClock:
    """One request's timestamps (time.monotonic) and where its parts ran, as the pipeline sees them."""

    received: float
    first_token: float | None = None
    last_chunk: float | None = None
    arrived: bool = False  # counted as an arrival (first route only)
    ttft_pool: str = ""


class RequestMetrics:
    """The histograms and counters above, in their own registry (one per router, so tests and
    several routers in one process never collide)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r, pool = self.registry, ["pool"]
        self.arrived = Counter("duet_requests_arrived", "requests routed to the pool", pool, registry=r)
        self.prompt_tokens = Histogram("duet_request_prompt_tokens", "prompt tokens per request", pool,
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("duet_request_output_tokens", "completion tokens per finished request",
                                       pool, buckets=TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram("duet_time_to_first_token_seconds", "router receipt to first streamed token", pool,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("duet_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1)", pool,
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("duet_inter_token_latency_seconds", "gap between streamed chunks", pool,
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("duet_e2e_request_latency_seconds", "router receipt to last token", pool,
                             buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter("duet_requests_finished", "finished requests by finish reason",
                                ["pool", "finish_reason"], registry=r)
        self.wake = Histogram("duet_wake_seconds", "a request held while its pool woke from zero replicas: held to "
                              "a worker taken", pool, buckets=E2E_BUCKETS, registry=r)

    def woke(self, pools: tuple[str, ...], seconds: float) -> None:
        """A request held while ``pools`` woke from zero took a worker after ``seconds``."""
        for pool in pools:
            self.wake.labels(pool).observe(seconds)

    def routed(self, clock: RequestClock, prompt_pool: str, decode_pool: str, prompt_tokens: int) -> None:
        """A route was chosen. Counts one arrival per pool involved, on the request's first route only."""
        if clock.arrived:
            return
        clock.arrived = True
        for pool in {prompt_pool, decode_pool}:
            self.arrived.labels(pool).inc()
        self.prompt_tokens.labels(prompt_pool).observe(prompt_tokens)
        clock.ttft_pool = prompt_pool

    def chunk(self, clock: RequestClock, decode_pool: str, now: float | None = None) -> None:
        """Tokens were streamed to the client (one chunk)."""
        now = time.monotonic() if now is None else now
        if clock.first_token is None:
            clock.first_token = now
            self.ttft.labels(clock.ttft_pool or decode_pool).observe(now - clock.received)
        elif clock.last_chunk is not None:
            self.itl.labels(decode_pool).observe(now - clock.last_chunk)
        clock.last_chunk = now

    def finished_request(self, clock: RequestClock, decode_pool: str, output_tokens: int, finish_reason: str,
                         now: float | None = None) -> None:
        """The request finished (its last chunk, if any, was already passed to ``chunk``)."""
        now = time.monotonic() if now is None else now
        e2e = now - clock.received
        self.e2e.labels(decode_pool).observe(e2e)
        self.output_tokens.labels(decode_pool).observe(output_tokens)
        self.finished.labels(decode_pool, finish_reason).inc()
        if output_tokens >= 2 and clock.first_token is not None:
            self.tpot.labels(decode_pool).observe((now - clock.first_token) / (output_tokens - 1))
