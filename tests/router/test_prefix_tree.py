"""PrefixTree: whole-block matching, per-worker LRU eviction bounds, and the prefix invariant."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from router.prefix_tree import PrefixTree, block_hashes


def _walk(tree: PrefixTree):
    """Every (node, parent) pair in the tree."""
    stack = [tree._root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            yield child, node
            stack.append(child)


def _check_invariants(tree: PrefixTree) -> None:
    nodes = 0
    for node, parent in _walk(tree):
        nodes += 1
        assert node.workers, "a node nobody holds must be deleted"
        if parent is not tree._root:
            assert node.workers <= parent.workers, "a holder of a block holds its whole prefix"
        for w in node.workers:
            assert node in tree._lru[w]
    assert nodes == tree.num_blocks()
    for w, lru in tree._lru.items():
        assert lru, "a worker with no blocks must be dropped"
        order = {n: i for i, n in enumerate(lru)}
        for n in lru:
            assert w in n.workers
            if n.parent is not tree._root:
                assert order[n.parent] > order[n], "parents must be more recent than children"


def test_block_hashes_cover_whole_blocks_only():
    assert block_hashes([], 4) == []
    assert block_hashes([1, 2, 3], 4) == []
    h = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(h) == 2
    assert block_hashes([1, 2, 3, 4], 4) == h[:1]
    assert block_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4) == [h[1], h[0]]  # content, not position


def test_docstring_example():
    tree = PrefixTree()
    tree.insert("w0", block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))
    assert tree.match(block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)) == {"w0": 1}


def test_match_reports_leading_blocks_per_worker():
    tree = PrefixTree()
    a = block_hashes(list(range(64)), 16)  # 4 blocks
    b = a[:2] + block_hashes([99] * 32, 16)  # shares 2 blocks with a, then diverges
    tree.insert("w0", a)
    tree.insert("w1", b)
    tree.insert("w2", a[:1])
    assert tree.match(a) == {"w0": 4, "w1": 2, "w2": 1}
    assert tree.match(b) == {"w0": 2, "w1": 4, "w2": 1}
    assert tree.match(a[:3]) == {"w0": 3, "w1": 2, "w2": 1}
    assert tree.match(block_hashes([7] * 16, 16)) == {}
    assert tree.match([]) == {}
    assert tree.num_blocks() == 6  # 4 + 2 divergent
    assert (tree.num_blocks("w0"), tree.num_blocks("w1"), tree.num_blocks("w2")) == (4, 4, 1)
    _check_invariants(tree)


def test_per_worker_lru_eviction_removes_leaves_first():
    tree = PrefixTree()
    old = block_hashes(list(range(48)), 16)  # 3 blocks
    new = block_hashes(list(range(100, 132)), 16)  # 2 blocks
    tree.insert("w0", old, max_blocks=4)
    assert tree.insert("w0", new, max_blocks=4) == 1  # 5 > 4: the oldest leaf goes
    assert tree.match(old) == {"w0": 2}  # the prefix shrank from its end
    assert tree.match(new) == {"w0": 2}
    assert tree.num_blocks("w0") == 4
    _check_invariants(tree)


def test_reinsert_refreshes_recency():
    tree = PrefixTree()
    a = block_hashes(list(range(32)), 16)
    b = block_hashes(list(range(100, 132)), 16)
    c = block_hashes(list(range(200, 232)), 16)
    tree.insert("w0", a, max_blocks=4)
    tree.insert("w0", b, max_blocks=4)
    tree.insert("w0", a, max_blocks=4)  # a is now the most recent
    tree.insert("w0", c, max_blocks=4)  # evicts b, not a
    assert tree.match(a) == {"w0": 2} and tree.match(b) == {} and tree.match(c) == {"w0": 2}
    _check_invariants(tree)


def test_eviction_is_per_worker_on_shared_nodes():
    tree = PrefixTree()
    shared = block_hashes(list(range(64)), 16)
    tree.insert("w0", shared, max_blocks=8)
    tree.insert("w1", shared, max_blocks=8)
    tree.insert("w1", block_hashes(list(range(500, 564)), 16), max_blocks=4)  # w1 evicts all of `shared`
    assert tree.match(shared) == {"w0": 4}
    assert tree.num_blocks() == 8
    _check_invariants(tree)


def test_a_path_longer_than_the_cap_keeps_its_head():
    tree = PrefixTree()
    long = block_hashes(list(range(160)), 16)  # 10 blocks
    assert tree.insert("w0", long, max_blocks=3) == 7
    assert tree.match(long) == {"w0": 3}
    _check_invariants(tree)


def test_remove_worker_frees_its_nodes():
    tree = PrefixTree()
    a = block_hashes(list(range(64)), 16)
    tree.insert("w0", a)
    tree.insert("w1", a[:2])
    assert tree.remove_worker("w0") == 4
    assert tree.match(a) == {"w1": 2}
    assert tree.num_blocks() == 2 and tree.workers == ["w1"]
    assert tree.remove_worker("w0") == 0  # idempotent
    tree.remove_worker("w1")
    assert tree.num_blocks() == 0 and not tree._root.children
    _check_invariants(tree)


def test_random_operations_match_a_reference_model():
    """Against a plain model: per worker, an LRU of prefixes (tuples of block hashes)."""
    rng = random.Random(0)
    tree = PrefixTree()
    ref: dict[str, OrderedDict[tuple, None]] = {}
    cap = {"w0": 6, "w1": 10, "w2": 3}
    # A few families of prompts that share prefixes, so paths overlap and diverge.
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    for step in range(600):
        w = rng.choice(sorted(cap))
        if rng.random() < 0.03:
            tree.remove_worker(w)
            ref.pop(w, None)
            continue
        hashes = rng.choice(stems)[: rng.randrange(1, 6)] + [rng.randrange(50) for _ in range(rng.randrange(3))]
        tree.insert(w, hashes, max_blocks=cap[w])
        lru = ref.setdefault(w, OrderedDict())
        for k in range(len(hashes), 0, -1):  # deepest first, as documented
            lru[tuple(hashes[:k])] = None
            lru.move_to_end(tuple(hashes[:k]))
        while len(lru) > cap[w]:
            lru.popitem(last=False)
        query = rng.choice(stems) + [rng.randrange(50)]
        want = {}
        for wid, held in ref.items():
            k = 0
            while k < len(query) and tuple(query[: k + 1]) in held:
                k += 1
            if k:
                want[wid] = k
        assert tree.match(query) == want, step
        assert all(tree.num_blocks(wid) == len(held) <= cap[wid] for wid, held in ref.items())
        assert tree.num_blocks() <= sum(cap.values())
    _check_invariants(tree)


def test_bad_cap_is_an_internal_error():
    with pytest.raises(AssertionError):
        PrefixTree().insert("w0", [1], max_blocks=0)
