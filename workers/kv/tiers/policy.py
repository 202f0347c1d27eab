"""Which block a full host tier gives up first (``cache.tier_policy``): the order of its keys.

``lru``  least recently used first.
``arc``  Adaptive Replacement Cache (Megiddo and Modha, FAST 2003): T1 holds keys used once since they
         came in, T2 keys used again; ghost lists B1 / B2 remember the keys each gave up, and a new
         key that is a ghost moves T1's target share ``p`` towards the list that would have kept it.
         A burst of blocks used once (a scan: long one-off prompts) cannot flush blocks used again
         unless the workload shows that recency pays.

Neither wins everywhere: ``benchmarks/tier_policy_sim.py`` replays chat, RAG and mixed traces through
both (benchmarks/README.md). An order tracks keys only; the tier keeps the blocks and the byte budget.

Use (the tier's put, ``key`` not held): ``order.prepare(key)``, then ``order.evict()`` while the new
block does not fit, then ``order.admit(key)``. A hit: ``use``; a held key put again: ``refresh``;
dropped from outside: ``remove``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol


class Order(Protocol):
    def __contains__(self, key: Hashable) -> bool: ...
    def __len__(self) -> int: ...
    def prepare(self, key: Hashable) -> None: ...
    def admit(self, key: Hashable) -> None: ...
    def use(self, key: Hashable) -> None: ...
    def refresh(self, key: Hashable) -> None: ...
    def evict(self) -> Hashable: ...
    def remove(self, key: Hashable) -> None: ...
    def clear(self) -> None: ...


class LRUOrder:
    def __init__(self, capacity: int = 0) -> None:  # (capacity: unused, as ARCOrder's signature)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def prepare(self, key: Hashable) -> None:
        pass

    def admit(self, key: Hashable) -> None:
        self._keys[key] = None

    def use(self, key: Hashable) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    refresh = use

    def evict(self) -> Hashable:
        return self._keys.popitem(last=False)[0]

    def remove(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()


class ARCOrder:
    def __init__(self, capacity: int) -> None:
        """capacity: how many keys the tier holds when full (its budget in blocks)."""
        assert capacity >= 1
        self.c = capacity
        self.p = 0.0  # T1's target size
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost = ""  # prepare's finding for the key being admitted: "b1", "b2" or ""

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def prepare(self, key: Hashable) -> None:
        if key in self.b1:  # recency would have kept it: T1's share grows
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self._ghost = "b1"
        elif key in self.b2:  # frequency would have kept it: T1's share shrinks
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self._ghost = "b2"
        else:
            self._ghost = ""

    def evict(self) -> Hashable:
        t1 = len(self.t1)
        if t1 and (not self.t2 or t1 > self.p or (self._ghost == "b2" and t1 == self.p)):
            key = self.t1.popitem(last=False)[0]
            self.b1[key] = None
        else:
            key = self.t2.popitem(last=False)[0]
            self.b2[key] = None
        self._trim()
        return key

    def admit(self, key: Hashable) -> None:
        (self.t2 if self._ghost else self.t1)[key] = None  # a ghost came back: used again
        self._ghost = ""
        self._trim()

    def use(self, key: Hashable) -> None:
        for t in (self.t1, self.t2):
            if key in t:
                del t[key]
                self.t2[key] = None
                return

    def refresh(self, key: Hashable) -> None:
        """Put again while held: up its own list (no new use: a tier's block put back after its
        load was already counted by ``use``)."""
        for t in (self.t1, self.t2):
            if key in t:
                t.move_to_end(key)
                return

    def remove(self, key: Hashable) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.p = 0.0

    def _trim(self) -> None:
        """The paper's bounds on the ghosts: |T1| + |B1| <= c, all four lists <= 2c."""
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)


ORDERS = {"lru": LRUOrder, "arc": ARCOrder}


def make_order(policy: str, capacity: int) -> Order:
    """The order of ``policy`` ('lru' | 'arc') for a tier of ``capacity`` keys."""
    return ORDERS[policy](capacity)
