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
        _check_pool_device(pool, f"pools[{i}]", s)


def _check_pool_device(pool: Any, p: str, s: Sources) -> None:
    """A pool that asks for CUDA must reserve GPUs (Ray gives a rank no GPU otherwise)."""
    dev = pool.engine.device
    need(not dev.startswith("cuda") or pool.gpus_per_rank > 0, f"{p}.engine.device", dev, s,
         f"{p}.gpus_per_rank is 0: a rank gets no GPU; set {p}.gpus_per_rank (e.g. 1) or device to auto / cpu")
    draft = pool.speculative.drafter_device
    need(draft != "cuda" or pool.gpus_per_rank > 0 or dev.startswith("cuda"), f"{p}.speculative.drafter_device",
         draft, s, f"{p}.gpus_per_rank is 0: a drafter on cuda beside a CPU target gets no GPU; use cpu or auto")


def _check_pool_role(pool: Any, p: str, s: Sources) -> None:
    need(pool.speculative.method == "none" or pool.role != "prefill", f"{p}.speculative.method",
         pool.speculative.method, s,
         f"{p}.role is prefill: a prefill pool produces one token per request; speculate on the decode pool")
