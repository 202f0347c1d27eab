"""Policy name -> class, and ``make_policy`` to build one from config.

Example::

    make_policy("prefix_aware", block_size=16, balance_abs_tokens=8192)
    make_policy("fastest")   # PolicyConfigError: unknown routing policy 'fastest'; valid: least_loaded, ...
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from router.policies.base import PolicyConfigError, RoutingPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.policies.round_robin import RoundRobinPolicy
from router.prefix_index import PrefixIndex

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadedPolicy, PrefixAwarePolicy)
}
DEFAULT_POLICY = "prefix_aware"


def policy_options(name: str) -> dict[str, Any]:
    """The keyword options of policy ``name`` and their defaults."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def make_policy(name: str, holdings: PrefixIndex | None = None, **opts: Any) -> RoutingPolicy:
    """Build policy ``name`` with ``opts``. Raises PolicyConfigError for an unknown name or option
    (listing the valid ones) or a bad option value (naming it). ``holdings``: the workers'
    reported prefix-cache holdings (router/prefix_index.py), a part, not an option: handed to the
    policies whose constructor takes it (prefix_aware) and unused by the others."""
    valid = policy_options(name)
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        raise PolicyConfigError(
            f"routing policy {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(sorted(valid)) or '(none)'}"
        )
    cls: Any = POLICIES[name]  # the policies' constructors differ; the protocol covers their instances
    if holdings is not None and "holdings" in inspect.signature(cls.__init__).parameters:
        return cast(RoutingPolicy, cls(holdings, **opts))
    return cast(RoutingPolicy, cls(**opts))


def _lookup(name: str) -> type[RoutingPolicy]:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise PolicyConfigError(
            f"unknown routing policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}"
        ) from None
