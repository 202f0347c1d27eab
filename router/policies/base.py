"""The routing-policy protocol and the typed messages it works on.

A policy answers one question: which worker gets this request? The router calls
``policy.select(request, workers)`` with a fresh snapshot of the pool, sends the request to the
returned worker id, updates its own per-worker counters (the router-side fields of WorkerState),
and calls ``policy.on_request_complete(worker_id, request_id)`` when the stream ends (any way).
Policies keep state (rotation, prefix tree) and are not thread-safe: call them from one thread
(the router's event loop); ``select`` never blocks and does no I/O.

Terms:
    load report     the worker's own numbers (duet.worker.v1.LoadReport), polled periodically.
    router-side     what the router knows before the next report: requests it routed and has not
                    seen finish, and the ones routed since the last report (so a burst between
                    two reports does not all land on the worker that looked idlest).
    load_tokens     the one load number policies compare (see WorkerState.load_tokens).

Worked example::

    policy = make_policy("least_loaded")
    workers = [WorkerState("w0", "10.0.0.1:50061", outstanding_tokens=900),
               WorkerState("w1", "10.0.0.2:50061", outstanding_tokens=100)]
    policy.select(RouteRequest("r1", [1, 2, 3]), workers)   # -> "w1"
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from workers.block_hash import adapter_root

if TYPE_CHECKING:
    from protos.duet.worker.v1 import worker_pb2


class RoutingError(Exception):
    """Base of the routing errors."""


class NoWorkersAvailable(RoutingError):
    """No healthy worker to route to (the server maps this to gRPC UNAVAILABLE)."""


class PolicyConfigError(RoutingError, ValueError):
    """An unknown policy name or a bad policy option; the message names it and the valid choices."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy sees of a request: its id and prompt token ids (after the chat template).

    max_tokens: the output budget (0 if unknown); it only feeds ``cost_tokens``.
    adapter: the request's LoRA adapter ("" = the base model): its prefix blocks chain from
        ``prefix_root`` (workers/block_hash.py), so no prefix matches across adapters, and
        router/policies/adapter_affinity.py prefers workers holding it.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int = 0
    adapter: str = ""

    @property
    def prefix_root(self) -> int:
        """The root of this request's prefix chain hashes (workers/block_hash.py adapter_root)."""
        return adapter_root(self.adapter)

    @property
    def cost_tokens(self) -> int:
        """Tokens this request adds to a worker's load before any prefix-cache hit: the same
        formula as LoadReport.outstanding_tokens for a fresh request, P + M - 1 (at least P)."""
        return len(self.prompt_token_ids) + max(self.max_tokens - 1, 0)


@dataclass(frozen=True)
class WorkerState:
    """One worker as the router sees it at routing time: identity, health, the numbers of its
    latest LoadReport (zeros before the first one) and the router-side counts.

    in_flight_requests: routed by this router and not finished yet (all time, not reset by reports).
    routed_requests_since_report / routed_tokens_since_report: routed after the latest report was
        taken (sum of RouteRequest.cost_tokens); the router resets both to 0 when a report arrives.
    """

    worker_id: str
    endpoint: str = ""
    healthy: bool = True
    role: str = "colocated"  # pool role: colocated | prefill | decode (see router/policies/disagg.py)
    drafter_pool: str = ""  # the drafter pool its speculative requests draft on (router/policies/drafter.py)
    incarnation: str = ""  # LoadReport.incarnation; "" until the first report
    model: str = ""  # the served model (its pool's); "" = the router's default model
    adapters: frozenset[str] = frozenset()  # LoRA adapters its latest LoadReport lists as loaded
    max_loaded_adapters: int = 0  # its adapter set's bound (LoadReport); 0 = it serves no adapters
    # From the latest LoadReport.
    num_running: int = 0
    num_waiting: int = 0
    outstanding_tokens: int = 0
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    # Router-side.
    in_flight_requests: int = 0
    routed_requests_since_report: int = 0
    routed_tokens_since_report: int = 0

    @classmethod
    def from_load_report(cls, report: worker_pb2.LoadReport, *, endpoint: str, healthy: bool = True,
                         in_flight_requests: int = 0, routed_requests_since_report: int = 0,
                         routed_tokens_since_report: int = 0) -> WorkerState:
        return cls(
            worker_id=report.worker_id, endpoint=endpoint, healthy=healthy, incarnation=report.incarnation,
            num_running=report.num_running, num_waiting=report.num_waiting,
            outstanding_tokens=report.outstanding_tokens, kv_block_size=report.kv_block_size,
            kv_blocks_total=report.kv_blocks_total, kv_blocks_used=report.kv_blocks_used,
            in_flight_requests=in_flight_requests, routed_requests_since_report=routed_requests_since_report,
            routed_tokens_since_report=routed_tokens_since_report, adapters=frozenset(report.adapters),
            max_loaded_adapters=report.max_loaded_adapters,
        )

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by requests, 0.0 before the first report."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def load_tokens(self) -> int:
        """The load policies compare, in tokens of KV: what this worker will hold once every
        request it has, or is about to receive, runs to max_tokens.

            load_tokens = kv_blocks_used * kv_block_size      KV held now (running requests)
                        + outstanding_tokens                   KV still to be computed (reported)
                        + routed_tokens_since_report           the same, for requests the report
                                                               does not include yet (router-side)

        Work (outstanding) and memory pressure (KV held) in one unit; 0 for an idle worker.
        Example: 10 blocks x 16 used, 300 outstanding, one 50-token request routed since the
        report -> 160 + 300 + 50 = 510. Raw tokens, not a fraction of capacity: a pool's
        workers are alike, and a worker that has not reported yet still compares sensibly.
        """
        return self.kv_blocks_used * self.kv_block_size + self.outstanding_tokens + self.routed_tokens_since_report


@runtime_checkable
class RoutingPolicy(Protocol):
    """What the router needs of a policy (after SGLang's LoadBalancingPolicy).

    ``select`` never returns an unhealthy worker and raises NoWorkersAvailable when none is
    healthy. ``workers`` is the pool's whole membership: a worker missing from it has left.
    """

    name: ClassVar[str]

    def select(self, request: RouteRequest, workers: Sequence[WorkerState]) -> str: ...

    def on_request_complete(self, worker_id: str, request_id: str) -> None: ...

    def counters(self) -> dict[str, int]:
        """Monotonic event counts (fallbacks, hits), exported as metrics by the router."""
        ...


def healthy_workers(workers: Sequence[WorkerState]) -> list[WorkerState]:
    """The healthy subset, in the given order; raises NoWorkersAvailable if it is empty."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoWorkersAvailable(
            f"no healthy worker to route to ({len(workers)} known, all unhealthy)" if workers
            else "no workers registered"
        )
    return healthy


def log_fallback(logger: logging.Logger, count: int, msg: str, *args: object) -> None:
    """Log a routing fallback: WARNING on the 1st, 2nd, 4th, 8th... occurrence (so a sustained
    overload is visible without one line per request), DEBUG otherwise. ``count`` is the
    fallback counter after incrementing; the message is logged with it appended."""
    level = logging.WARNING if count & (count - 1) == 0 else logging.DEBUG
    logger.log(level, msg + " (fallback #%d)", *args, count)
