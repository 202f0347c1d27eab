"""Host buffers for received KV payloads, reused across transfers (workers/kv/channel.py).

Why. A receiver that allocates a fresh tensor for every payload pays the page faults of new
memory on each transfer: the kernel zeroes and maps every page on first touch, which costs more
than copying the payload itself, most of all in sandboxed kernels (gVisor). Reusing memory that
was touched before removes that cost from every transfer after the first.

When a buffer is free again. The receiver hands the payload tensor to its consumer (the engine
imports it into the KV cache, later, on its own thread) and cannot know when that consumer is done.
So each buffer is a numpy array that only this pool references, and the tensors handed out view it
through ``torch.frombuffer``: each such tensor (and every view of it) holds a reference to the
array, so the array's reference count is back to the pool's own exactly when every tensor made
from it is gone. Only then is the buffer handed out again; otherwise a new one is made.

Bounds: at most ``max_bytes`` kept in all; a payload larger than ``max_bytes`` gets memory of its
own. Thread-safe (the pairs' receive loops take buffers concurrently).
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch


class _Buffer:
    __slots__ = ("array", "idle_refs")

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.array.fill(0)  # touch every page now: later transfers find it mapped
        self.idle_refs = self.refs()

    def refs(self) -> int:
        return sys.getrefcount(self.array)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


class RecvBuffers:
    """A pool of reusable host buffers; ``take`` returns a contiguous CPU tensor (contents undefined)."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._buffers: list[_Buffer] = []  # most recently made last

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.max_bytes or nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            free = [b for b in self._buffers if b.nbytes >= nbytes and b.refs() == b.idle_refs]
            if free:
                buf = min(free, key=lambda b: b.nbytes)  # the tightest fit
            else:
                buf = _Buffer(nbytes)
                self._buffers.append(buf)
                self._evict()
            view = torch.frombuffer(buf.array, dtype=torch.uint8, count=nbytes)
        return view.view(dtype).view(shape)

    def _evict(self) -> None:
        """Forget the oldest buffers beyond ``max_bytes`` (one in use stays alive with its consumer)."""
        while sum(b.nbytes for b in self._buffers) > self.max_bytes and len(self._buffers) > 1:
            self._buffers.pop(0)

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._buffers)

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
