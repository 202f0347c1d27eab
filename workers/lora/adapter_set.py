"""AdapterSet: the bounded set of LoRA adapters one worker holds, by name, in slots of LoraStacks.

Terms:
    slot      one of ``lora.max_loaded`` places in the stacks (workers/lora/stacks.py)
    in use    requests running with the adapter now (``acquire`` at admission, ``release`` when the
              request ends for any reason: finished, aborted, migrated away)
    pinned    never evicted by the LRU (``unload`` still removes it once idle)

``load(name, source)`` reads and validates the adapter (workers/lora/reader.py) *outside* the set's
lock, then places it: into a free slot, or into the slot of the least recently used adapter that is
neither pinned nor in use (evicted). A set whose every slot is pinned or in use refuses
(AdapterCapacityError). Loading a name already loaded only refreshes its recency (and pins it
when asked); a different source under the same name is refused (unload it first).

Worked example (max_loaded 2): load a, load b, acquire b -> both held; load c evicts a (b is in
use); unload b -> AdapterInUse until release(b).

Thread safety: the service loads and unloads on its own threads while the engine thread acquires,
releases and steps; one lock guards the tables, and a slot is written only while no request uses it
(a free or evicted slot), so a running step never reads a slot that is being rewritten.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from workers.config import LoraConfig
from workers.lora.errors import AdapterCapacityError, AdapterError, AdapterInUse, AdapterNotLoaded
from workers.lora.reader import LoraAdapter, read_adapter
from workers.lora.stacks import LoraStacks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterInfo:
    """What ListAdapters reports of one adapter (protos AdapterInfo)."""

    name: str
    source: str
    rank: int
    target_modules: tuple[str, ...]
    pinned: bool
    in_use: int
    load_seconds: float
    bytes: int


@dataclass
class _Held:
    adapter: LoraAdapter
    slot: int
    pinned: bool
    load_seconds: float
    in_use: int = 0


class AdapterSet:
    def __init__(self, stacks: LoraStacks, config: LoraConfig) -> None:
        assert stacks.num_slots == config.max_loaded and stacks.max_rank == config.max_rank
        self.stacks = stacks
        self.config = config
        self._lock = threading.Lock()
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._free = list(range(config.max_loaded - 1, -1, -1))  # pop() -> lowest free slot
        self.evictions = 0

    @property
    def max_loaded(self) -> int:
        return self.config.max_loaded

    # ----------------------------------------------------------------- admin
    def load(self, name: str, source: str, pin: bool = False) -> AdapterInfo:
        """Make ``name`` resident (see the module docstring); AdapterError / AdapterCapacityError."""
        with self._lock:
            held = self._held.get(name)
            if held is not None:
                return self._refresh(held, name, source, pin)
        t0 = time.perf_counter()
        adapter = read_adapter(name, source, self.stacks.targets, self.config.max_rank)  # off the lock
        with self._lock:
            held = self._held.get(name)
            if held is not None:  # a concurrent load of the same name won
                return self._refresh(held, name, source, pin)
            slot = self._take_slot(name)
            self.stacks.place(slot, adapter)
            held = self._held[name] = _Held(adapter, slot, pin, time.perf_counter() - t0)
            logger.info("LoRA adapter %r loaded from %s into slot %d (rank %d, %s) in %.3fs", name, source, slot,
                        adapter.rank, ",".join(adapter.target_modules), held.load_seconds)
            return self._info(name, held)

    def _refresh(self, held: _Held, name: str, source: str, pin: bool) -> AdapterInfo:
        if source and held.adapter.source != source:
            raise AdapterError(f"adapter {name!r} is loaded from {held.adapter.source!r}, not {source!r}; unload it "
                               "before loading another adapter under its name")
        held.pinned = held.pinned or pin
        self._held.move_to_end(name)
        return self._info(name, held)

    def _take_slot(self, name: str) -> int:
        if self._free:
            return self._free.pop()
        for victim, held in self._held.items():  # least recently used first
            if not held.pinned and held.in_use == 0:
                del self._held[victim]
                self.evictions += 1
                logger.info("LoRA adapter %r evicted from slot %d for %r", victim, held.slot, name)
                return held.slot
        raise AdapterCapacityError(f"adapter {name!r}: all {self.max_loaded} adapter slots (lora.max_loaded) hold "
                                   "pinned adapters or adapters in use; unload one or raise lora.max_loaded")

    def unload(self, name: str) -> None:
        """Remove ``name``: AdapterNotLoaded if absent, AdapterInUse while requests run with it."""
        with self._lock:
            held = self._held.get(name)
            if held is None:
                raise AdapterNotLoaded(f"adapter {name!r} is not loaded on this worker")
            if held.in_use:
                raise AdapterInUse(f"adapter {name!r} has {held.in_use} running request(s); unload it when they end")
            del self._held[name]
            self.stacks.clear(held.slot)
            self._free.append(held.slot)
            logger.info("LoRA adapter %r unloaded from slot %d", name, held.slot)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(n, h) for n, h in self._held.items()]

    def names(self) -> builtins.list[str]:
        with self._lock:
            return list(self._held)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._held

    @staticmethod
    def _info(name: str, held: _Held) -> AdapterInfo:
        a = held.adapter
        return AdapterInfo(name, a.source, a.rank, a.target_modules, held.pinned, held.in_use, held.load_seconds,
                           a.nbytes)

    # --------------------------------------------------------------- requests
    def acquire(self, name: str) -> int:
        """One more request runs with ``name``: its slot (AdapterNotLoaded if absent)."""
        with self._lock:
            held = self._held.get(name)
            if held is None:
                raise AdapterNotLoaded(f"adapter {name!r} is not loaded on this worker")
            held.in_use += 1
            self._held.move_to_end(name)
            return held.slot

    def release(self, name: str) -> None:
        with self._lock:
            held = self._held.get(name)
            assert held is not None and held.in_use > 0, f"release of {name!r} without acquire"
            held.in_use -= 1

    def source(self, name: str) -> str:
        """Where ``name`` was loaded from (AdapterNotLoaded if absent)."""
        with self._lock:
            held = self._held.get(name)
            if held is None:
                raise AdapterNotLoaded(f"adapter {name!r} is not loaded on this worker")
            return held.adapter.source

    def in_use(self, name: str) -> int:
        with self._lock:
            held = self._held.get(name)
            return 0 if held is None else held.in_use
