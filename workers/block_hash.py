"""Prefix block hashes: the one name a KV block's prefix has on the worker and on every router.

A worker's prefix cache keys each full, computed block by the whole prefix it ends
(workers/engine/block_manager.py). To tell routers *which* prefixes it holds, the worker reports
each key as a 64-bit **chain hash**:

    h(block 0) = H(ROOT, tokens of block 0)
    h(block i) = H(h(block i - 1), tokens of block i)

so a hash names the block *and everything before it*, and a router can match a prompt against a
worker's report with one dict lookup per block, no tree (router/prefix_index.py). H is Python's
tuple hash of ``(parent, tokens)`` reduced to 64 unsigned bits: every value in it is an int, and
ints (unlike str and bytes) hash the same in every process whatever PYTHONHASHSEED says, so a
router and a worker running the same Python compute the same hash (the chart runs one image for
both). A collision (2^-64 per pair) would cost a wrong routing guess, never a wrong answer: the
worker checks the tokens themselves before reusing a block.

Example (block_size 4)::

    chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)   # two hashes; the partial block [9] is no block
    chain_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)[0] == chain_hashes([1, 2, 3, 4, 9], 4)[0]   # True

Pure Python and torch-free: the router imports it (tests/test_package_graph.py).
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0  # the parent of a prompt's first block
_MASK = (1 << 64) - 1


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The hash of a block holding ``tokens`` after the prefix whose last block hashes to ``parent``."""
    return hash((parent, tokens)) & _MASK


def chain_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The chain hashes of the full blocks of ``token_ids`` (at most ``limit`` of them)."""
    assert block_size > 0
    ids = tuple(token_ids)
    n = len(ids) // block_size if limit is None else min(len(ids) // block_size, limit)
    out: list[int] = []
    parent = ROOT
    for i in range(n):
        parent = hash((parent, ids[i * block_size : (i + 1) * block_size])) & _MASK
        out.append(parent)
    return out
