"""PrefixTree: an approximate map of which worker holds which prompt prefix in its KV cache.

The router cannot see the workers' caches; it remembers what it *sent* where. Each prompt is cut
into full blocks of ``block_size`` token ids (the same size as the workers' KV blocks, so a match
here is a run of blocks a worker can reuse; a trailing partial block is never cached there, so it
is ignored here too). The tree is a trie with one node per block, children keyed by a hash of the
block's token ids; a path from the root spells a prefix. Each node records the workers that were
sent that prefix.

Why one node per block and not a compressed radix tree: the workers cache and evict whole blocks,
so per-block nodes give per-worker LRU eviction that mirrors theirs exactly, without splitting or
merging edges. A match costs one dict lookup per block either way.

Invariant: if a worker holds a node, it holds the node's parent (it was sent the whole prefix).
Per-worker LRU keeps it: touching a path touches the deepest node first and the root-most last,
so a parent is always more recent than its children and eviction (least recent first) always
removes a worker's leaves before their ancestors. A node nobody holds is deleted at once, so the
tree's size is at most the sum of the per-worker caps.

"Approximate": a worker may have evicted blocks the tree still lists (its cache is under other
pressure) and hash collisions are possible (64-bit, within one parent: negligible); a wrong guess
only costs a cache miss, never a wrong answer.

Example (block_size=4)::

    tree = PrefixTree()
    tree.insert("w0", block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))   # 2 blocks; the 9 is ignored
    tree.match(block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4))          # -> {"w0": 1}
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """Hash each full block of ``token_ids`` (position is implied by depth in the tree). ``root``:
    the request's prefix root (RouteRequest.prefix_root, non-zero under a LoRA adapter), mixed into
    every block so no block matches across adapters or the base model."""
    assert block_size > 0
    ids = tuple(token_ids)  # one copy; slicing a tuple then yields hashable blocks directly
    n = len(ids) - len(ids) % block_size
    if root:
        return [hash((root, ids[i : i + block_size])) for i in range(0, n, block_size)]
    return [hash(ids[i : i + block_size]) for i in range(0, n, block_size)]


class _Node:
    __slots__ = ("key", "parent", "children", "workers")

    def __init__(self, key: int, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.workers: set[str] = set()


class PrefixTree:
    def __init__(self) -> None:
        self._root = _Node(0, None)
        # worker id -> the nodes it holds, least recently used first (values unused)
        self._lru: dict[str, OrderedDict[_Node, None]] = {}
        self._num_nodes = 0

    # ----------------------------------------------------------------- queries
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding at least the first block: how many leading blocks it holds."""
        matched: dict[str, int] = {}
        node = self._root
        for depth, h in enumerate(hashes, 1):
            child = node.children.get(h)
            if child is None:
                break
            node = child
            for w in node.workers:  # holders of a node also hold all its ancestors
                matched[w] = depth
        return matched

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Blocks held by ``worker_id``, or tree nodes in all (worker_id None)."""
        if worker_id is not None:
            return len(self._lru.get(worker_id, ()))
        return self._num_nodes

    @property
    def workers(self) -> list[str]:
        return list(self._lru)

    # ----------------------------------------------------------------- updates
    def insert(self, worker_id: str, hashes: Sequence[int], max_blocks: int | None = None) -> int:
        """Record that ``worker_id`` was sent this prefix, mark it most recently used, then evict
        the worker's least recently used blocks beyond ``max_blocks``. Returns blocks evicted."""
        assert max_blocks is None or max_blocks >= 1
        if not hashes:
            return 0
        lru = self._lru.setdefault(worker_id, OrderedDict())
        path = []
        node = self._root
        for h in hashes:
            child = node.children.get(h)
            if child is None:
                child = node.children[h] = _Node(h, node)
                self._num_nodes += 1
            child.workers.add(worker_id)
            path.append(child)
            node = child
        touch = lru.move_to_end
        for n in reversed(path):  # deepest first: parents end up more recent than children
            if n in lru:
                touch(n)
            else:
                lru[n] = None
        evicted = 0
        if max_blocks is not None:
            while len(lru) > max_blocks:
                self._drop(lru.popitem(last=False)[0], worker_id)
                evicted += 1
        return evicted

    def remove_worker(self, worker_id: str) -> int:
        """Forget everything sent to ``worker_id`` (it left, or restarted with an empty cache)."""
        lru = self._lru.pop(worker_id, None)
        if not lru:
            return 0
        for n in lru:  # leaves first, by the invariant
            self._drop(n, worker_id)
        return len(lru)

    def _drop(self, node: _Node, worker_id: str) -> None:
        node.workers.discard(worker_id)
        if not node.workers:
            # Nobody holds it, so nobody holds a descendant: it is a leaf.
            assert not node.children, "prefix invariant broken: an unheld node has children"
            assert node.parent is not None, "the root is never held, so never dropped"
            del node.parent.children[node.key]
            self._num_nodes -= 1
        if worker_id in self._lru and not self._lru[worker_id]:
            del self._lru[worker_id]
