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

A request run under a LoRA adapter starts its chain from ``adapter_root(name)`` instead of ROOT,
so its blocks never share a name (or a cache entry) with the base model's or another adapter's:
the same tokens under another adapter have other keys and values.

Example (block_size 4)::

    chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)   # two hashes; the partial block [9] is no block
    chain_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)[0] == chain_hashes([1, 2, 3, 4, 9], 4)[0]   # True
    chain_hashes([1, 2, 3, 4], 4, root=adapter_root("sql"))[0] != chain_hashes([1, 2, 3, 4], 4)[0]   # True

Pure Python and torch-free: the router imports it (tests/test_package_graph.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import IntEnum

ROOT = 0  # the parent of a prompt's first block
_MASK = (1 << 64) - 1


class Tier(IntEnum):
    """Where a worker holds a block (LoadReport.blocks_stored_tiers): lower is faster to serve.
    DEVICE: its KV cache (GPU or CPU memory); HOST and DISK: its lower KV tiers
    (workers/engine/kv_tiers.py). PENDING: not held yet, but a request admitted here is about to
    compute it (its prompt's blocks from admission until its first token), so a router routing
    the same new prefix elsewhere would make a second copy; nothing can be read from a PENDING
    block (prefix pulls ignore it). Numbered last so that any real tier wins."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    PENDING = 3


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The hash of a block holding ``tokens`` after the prefix whose last block hashes to ``parent``."""
    return hash((parent, tokens)) & _MASK


def adapter_root(adapter: str) -> int:
    """The chain's root for requests run under LoRA adapter ``adapter`` ("" = the base model: ROOT).
    A digest of the name, not ``hash(str)``, which differs between processes (PYTHONHASHSEED)."""
    if not adapter:
        return ROOT
    return int.from_bytes(hashlib.blake2b(b"lora:" + adapter.encode(), digest_size=8).digest(), "little") | 1


def chain_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None, root: int = ROOT) -> list[int]:
    """The chain hashes of the full blocks of ``token_ids`` (at most ``limit`` of them), the first
    block's parent being ``root`` (``adapter_root(...)`` for a request run under an adapter)."""
    assert block_size > 0
    ids = tuple(token_ids)
    n = len(ids) // block_size if limit is None else min(len(ids) // block_size, limit)
    out: list[int] = []
    parent = root
    for i in range(n):
        parent = hash((parent, ids[i * block_size : (i + 1) * block_size])) & _MASK
        out.append(parent)
    return out
