"""Drafter policies: which drafter replica a speculative request drafts on.

A target worker whose pool names a drafter pool (``WorkerState.drafter_pool``, from the controller's
membership) gets, with each request, one replica of that pool: the router picks it here and hands its
endpoint and incarnation to the target (SubmitRequest.drafter). Many targets share one replica (it
batches their rounds) and one target's requests may spread over several (M:N). Like the worker
policies: a small protocol, a registry, one algorithm explained at the top; ``select`` never blocks
and runs on the router's loop.

least_loaded_affinity (the default), per request:
 1. candidates = the healthy, non-draining replicas of the target's drafter pool; none -> None (the
    request decodes without drafts; counted as ``drafter_none``).
 2. request affinity: a request that drafted on a replica before (a retry, a resume, a migrated
    request re-attaching; the drafter keeps its state by request id) keeps it while it is a
    candidate (``drafter_affinity_hits``); nothing is recomputed there.
 3. fan-out: a target already drafting on ``fanout`` replicas (this router's requests) picks among
    those (when any is a candidate): at 1,000 replicas a target keeps a few streams, not hundreds.
 4. least loaded: load(d) = requests d reported holding + requests routed to it since (router-side);
    ties go to the replica this target sends fewer requests to (so one target's requests spread over
    replicas: smaller rounds in parallel, and a lost replica costs it fewer drafts), then to the id.
    Remembered per request (LRU of ``max_requests``).

Example: targets t0, t1 and replicas d0, d1, requests arriving t0, t1, t0, t1 -> d0, d1, d1, d0: each
target drafts on both replicas and each replica batches both targets' rounds (M:N).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from router.policies.base import PolicyConfigError, RouteRequest, WorkerState


@dataclass(frozen=True)
class DrafterState:
    """One drafter replica as the router sees it (router/drafters.py keeps these).

    num_requests / num_active: from its last DrafterLoad (requests holding state / drafting now);
    routed_since_report: requests this router handed it since that report; targets: the workers
    this router has requests drafting on it right now, and how many each."""

    drafter_id: str
    endpoint: str
    pool: str
    healthy: bool = True
    incarnation: str = ""
    num_requests: int = 0
    num_active: int = 0
    routed_since_report: int = 0
    in_flight: int = 0
    targets: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)

    @property
    def load(self) -> int:
        return self.num_requests + self.routed_since_report


@runtime_checkable
class DrafterPolicy(Protocol):
    name: ClassVar[str]

    def select(self, request: RouteRequest, target: WorkerState, drafters: Sequence[DrafterState]) -> str | None:
        """The drafter id for ``request`` on ``target`` (``drafters``: every known replica), or None."""
        ...

    def counters(self) -> dict[str, int]: ...


class LeastLoadedAffinityPolicy:
    name: ClassVar[str] = "least_loaded_affinity"

    def __init__(self, *, fanout: int = 4, max_requests: int = 65536) -> None:
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
            raise PolicyConfigError(f"drafter policy fanout={fanout!r}: must be an integer >= 1")
        if not isinstance(max_requests, int) or isinstance(max_requests, bool) or max_requests < 1:
            raise PolicyConfigError(f"drafter policy max_requests={max_requests!r}: must be an integer >= 1")
        self.fanout = fanout
        self.max_requests = max_requests
        self._chosen: OrderedDict[str, str] = OrderedDict()  # request id -> drafter id
        self.counts = {"drafter_routes": 0, "drafter_affinity_hits": 0, "drafter_none": 0}

    def select(self, request: RouteRequest, target: WorkerState, drafters: Sequence[DrafterState]) -> str | None:
        pool = target.drafter_pool
        candidates = [d for d in drafters if d.pool == pool and d.healthy]
        if not candidates:
            self.counts["drafter_none"] += 1
            return None
        self.counts["drafter_routes"] += 1
        before = self._chosen.get(request.request_id)
        if before is not None and any(d.drafter_id == before for d in candidates):
            self.counts["drafter_affinity_hits"] += 1
            self._chosen.move_to_end(request.request_id)
            return before
        mine = [d for d in candidates if target.worker_id in d.targets]
        if len({d.drafter_id for d in drafters if target.worker_id in d.targets}) >= self.fanout and mine:
            candidates = mine
        best = min(candidates, key=lambda d: (d.load, d.targets.get(target.worker_id, 0), d.drafter_id))
        self._chosen[request.request_id] = best.drafter_id
        self._chosen.move_to_end(request.request_id)
        while len(self._chosen) > self.max_requests:
            self._chosen.popitem(last=False)
        return best.drafter_id

    def counters(self) -> dict[str, int]:
        return dict(self.counts)


DRAFTER_POLICIES: dict[str, type[DrafterPolicy]] = {cls.name: cls for cls in (LeastLoadedAffinityPolicy,)}
DEFAULT_DRAFTER_POLICY = "least_loaded_affinity"


def make_drafter_policy(name: str, **opts: object) -> DrafterPolicy:
    """Build drafter policy ``name``; PolicyConfigError for an unknown name or option."""
    cls = DRAFTER_POLICIES.get(name)
    if cls is None:
        raise PolicyConfigError(f"unknown drafter policy {name!r}; valid drafter policies: "
                                f"{', '.join(sorted(DRAFTER_POLICIES))}")
    try:
        return cls(**opts)
    except TypeError as e:
        raise PolicyConfigError(f"drafter policy {name!r}: {e}") from None
