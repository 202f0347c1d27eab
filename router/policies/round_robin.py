"""round_robin: each request goes to the next healthy worker in worker-id order.

Algorithm: keep the id of the last worker chosen; pick the first healthy worker whose id sorts
after it, wrapping around to the smallest. Cycling by id rather than by list position keeps the
rotation fair when workers join, leave or flap: a newcomer takes its turn in id order, and an
unhealthy worker is skipped without shifting anyone else's turn.

Example: healthy w0, w1, w2 and 30 requests -> w0, w1, w2, w0, ... 10 each. If w1 turns unhealthy
after request 4 (w0), the next requests go w2, w0, w2, ...

Ignores load and prefixes entirely: the baseline the other policies are measured against.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import RouteRequest, WorkerState, healthy_workers


class RoundRobinPolicy:
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def select(self, request: RouteRequest, workers: Sequence[WorkerState]) -> str:
        ids = sorted(w.worker_id for w in healthy_workers(workers))
        i = 0 if self._last is None else bisect.bisect_right(ids, self._last)
        self._last = ids[i % len(ids)]
        return self._last

    def on_request_complete(self, worker_id: str, request_id: str) -> None:
        pass  # stateless per request

    def counters(self) -> dict[str, int]:
        return {}
