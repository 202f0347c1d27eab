"""cold_home: where a prompt that no worker holds goes, so that several routers agree on it.

With several routers (active-active, issue 33) a new prefix arriving at two routers at once was
sent by each to the worker that looked idlest *to it* -- and each router counts its own recent
sends in that view, so they often differ: each worker then computes and caches its own copy, and
the prefix-hit rate drops below one router's. prefix_aware (router/policies/prefix_aware.py) sends
such a prompt to its *home* instead, a choice every router makes the same way from the same inputs:

    near   = the healthy workers whose *reported* load (LoadReport.outstanding_tokens: the same in
             every router) is at most the least reported load + this request's own cost
             (RouteRequest.cost_tokens): any of them is as good a place for it as the idlest
    home   = argmax over near of  score(w) = h(first block's chain hash, worker id)
             (rendezvous / highest-random-weight hashing: a worker joining or leaving moves only
             the prompts whose home it is or becomes)

The cost (measured, benchmarks/README.md ``routers_bench.py``): a router's own sends between two
reports do not spread its new prompts, so prompts that are all new (no shared prefix) spread as
randomly as their hashes, not as evenly as least-loaded does; with a shared-prefix workload the
hit-rate gap between several routers and one closes. So it is prefix_aware's option
``cold_home``, off by default.

The first block's hash is the one every request sharing that first block shares (and includes the
adapter's root: workers/block_hash.py), so the first sightings of a shared prefix land on one
worker from every router; after that the workers' reports route its requests there (prefix hits).
A prompt shorter than one block, or a request whose near set is empty (cannot happen: the least
loaded worker is always near), goes to ``fallback`` (the least-loaded worker). Loads are compared
on reports only, so a router's own sends since the last report do not pull its choice away from
the other routers'; they are taken into account from the next report on (every load poll).

Example: w0 reports 300 outstanding tokens, w1 0, w2 5000; a 272-token request (cost 303) finds
w0 and w1 near (300 <= 0 + 303), w2 not; its home is whichever of w0, w1 scores higher for its
first block, in every router.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from router.policies.base import RouteRequest, WorkerState


def score(first_block: int, worker_id: str) -> int:
    """The rendezvous weight of ``worker_id`` for a prompt whose first block hashes to ``first_block``:
    stable across processes and runs (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{first_block}:{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def cold_home(request: RouteRequest, first_block: int | None, healthy: Sequence[WorkerState],
              fallback: WorkerState) -> WorkerState:
    """The module docstring's home of ``request`` among ``healthy`` (first_block None: no full block)."""
    if first_block is None:
        return fallback
    lowest = min(w.outstanding_tokens for w in healthy)
    near = [w for w in healthy if w.outstanding_tokens <= lowest + request.cost_tokens]
    return max(near, key=lambda w: (score(first_block, w.worker_id), w.worker_id)) if near else fallback
