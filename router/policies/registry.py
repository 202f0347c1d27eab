"""Policy name -> class, and ``make_policy`` to build one from config.

Example::

    make_policy("prefix_aware", block_size=16, balance_abs_tokens=8192)
    make_policy("fastest")   # PolicyConfigError: unknown routing policy 'fastest'; valid: least_loaded, ...
"""

from __future__ import annotations

import inspect
from typing import Any

from router.policies.base import PolicyConfigError, RoutingPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadedPolicy, PrefixAwarePolicy)
}
DEFAULT_POLICY = "prefix_aware"


def policy_options(name: str) -> dict[str, Any]:
    """The keyword options of policy ``name`` and their defaults."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def make_policy(name: str, **opts: Any) -> RoutingPolicy:
    """Build policy ``name`` with ``opts``. Raises PolicyConfigError for an unknown name or option
    (listing the valid ones) or a bad option value (naming it)."""
    valid = policy_options(name)
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        raise PolicyConfigError(
            f"routing policy {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(sorted(valid)) or '(none)'}"
        )
    return POLICIES[name](**opts)


def _lookup(name: str) -> type[RoutingPolicy]:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise PolicyConfigError(
            f"unknown routing policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}"
        ) from None
