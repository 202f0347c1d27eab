"""Checks across sections: which pool roles, parallel sizes, quantization, speculation and devices
can work together. Each refusal names both keys and says what to change; a key's own range is
checked by its owner (workers/config.py, router/config.py), not here.

Called by cluster/config.py once every section is built (so ``duet serve --dry-run`` refuses the
same combinations as ``duet serve``). The Helm chart's values.schema.json refuses the ones it can
tell from values alone (deploy/helm/duet).
"""

from __future__ import annotations

from typing import Any

from cluster.config_sources import Sources, need


def check_combinations(c: Any, s: Sources) -> None:
    """``c``: the DuetConfig being built."""
    for i, pool in enumerate(c.pools):
        _check_pool_role(pool, f"pools[{i}]", s)


def _check_pool_role(pool: Any, p: str, s: Sources) -> None:
    need(pool.speculative.method == "none" or pool.role != "prefill", f"{p}.speculative.method",
         pool.speculative.method, s,
         f"{p}.role is prefill: a prefill pool produces one token per request; speculate on the decode pool")
