"""least_loaded: each request goes to the healthy worker with the smallest load.

Algorithm: minimise ``WorkerState.load_tokens`` = KV tokens held (from the worker's last
LoadReport) + outstanding tokens (same report) + tokens of requests this router sent it since that
report. The last term is what spreads a burst: between two reports every routed request raises
its worker's load by its own ``cost_tokens`` (prompt + max_tokens - 1), so the next request of
the burst already sees it. Ties go to fewer router-side in-flight requests, then to the smaller
worker id (deterministic, so tests and replays are reproducible).

Example: loads w0=0, w1=500, w2=1000 tokens and 30 requests of 100 tokens each, no report in
between -> w0 takes the first 5 alone (reaching 500), then w0 and w1 alternate until both reach
1000, then all three rotate: 15 / 10 / 5 in total, every worker ending at 1500.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import RouteRequest, WorkerState, healthy_workers


def least_loaded(workers: Sequence[WorkerState]) -> WorkerState:
    """The least loaded of ``workers`` (assumed non-empty and healthy), ties broken as above."""
    return min(workers, key=lambda w: (w.load_tokens, w.in_flight_requests, w.worker_id))


class LeastLoadedPolicy:
    name: ClassVar[str] = "least_loaded"

    def select(self, request: RouteRequest, workers: Sequence[WorkerState]) -> str:
        return least_loaded(healthy_workers(workers)).worker_id

    def on_request_complete(self, worker_id: str, request_id: str) -> None:
        pass  # the load numbers live in WorkerState, kept by the router

    def counters(self) -> dict[str, int]:
        return {}
