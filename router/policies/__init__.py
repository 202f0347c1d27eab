"""Routing policies: which worker gets a request. One file per policy, a small protocol in
``base.py`` and a registry; see each policy's module docstring for its algorithm.

    round_robin    next healthy worker in id order
    least_loaded   smallest WorkerState.load_tokens (reported load + router-side estimate)
    prefix_aware   the worker most likely to hold the prompt's prefix in its KV cache, unless
                   it is overloaded relative to the idlest worker (then least_loaded)

Wrapped around whichever is configured (router/pipeline.py), not chosen by name:
    adapter_affinity  a LoRA request prefers workers holding its adapter unless they are
                      overloaded (router/policies/adapter_affinity.py)
    disagg            the prefill half of a disaggregated route (router/policies/disagg.py)
"""

from router.policies.base import (
    NoWorkersAvailable,
    PolicyConfigError,
    RouteRequest,
    RoutingError,
    RoutingPolicy,
    WorkerState,
)
from router.policies.registry import DEFAULT_POLICY, POLICIES, make_policy, policy_options

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "NoWorkersAvailable",
    "PolicyConfigError",
    "RouteRequest",
    "RoutingError",
    "RoutingPolicy",
    "WorkerState",
    "make_policy",
    "policy_options",
]
