"""Shared-memory collectives for the ranks of one group that share a host (CPU tensors).

Why. A tensor-parallel decode step does two all-reduces per layer of a [B, E] tensor of a few KiB.
Over gloo each one is a loopback TCP round trip through the kernel, which costs far more than the
GEMV it splits (benchmarks/README.md, `parallel_bench.py`). Ranks on one host can instead meet in a shared memory segment: a copy in, a
flag store, a spin on the peers' flags, and a sum read straight out of the peers' memory.

Terms (the segment's layout and lifecycle: workers/parallel/shm_segment.py).
  - *segment*: one POSIX shared-memory file per group, created by group rank 0 under /dev/shm,
    mapped by every rank and **unlinked as soon as every rank has mapped it**, so nothing is left
    in /dev/shm whatever happens to the processes later (the kernel frees the memory when the last
    mapping goes). Files of creators that died before unlinking are swept by the next creator.
  - *slot*: ``SLOT_BYTES`` of the segment owned by one rank, written only by it. There are two
    slots per rank (*double buffering*): round s uses buffer s % 2.
  - *round*: every rank writes at most one slot's worth into its slot of buffer s % 2, stores
    s into its *sequence counter* (its own cache line in the header), then waits until every
    counter is >= s and reads whatever it needs from the peers' slots. A tensor larger than a slot
    takes several rounds, each one a chunk.
Why two buffers suffice: a rank publishes round s only after it has finished reading round s - 1,
so once a rank has seen every counter >= s (the end of round s), no peer still reads buffer
(s - 1) % 2 = (s + 1) % 2, which round s + 1 is about to overwrite. One barrier per round.

Collectives (every rank of the group calls them in the same order, with the same sizes):
  all_reduce(x)                  sum over the ranks in place; every rank sums in rank order, so
                                 all ranks get bit-identical results
  gather_to_first(x)             every rank's x on rank 0
  all_gather(x)                  every rank's x on every rank
  shift(x, out, src, max_bytes)  out <- rank src's x (a ring step when src is the previous rank)
  all_to_all(x, send, recv)      uneven all-to-all of rows (the MoE dispatch and combine)
  broadcast_bytes(data, src)     rank src's bytes on every rank (the gang's per-step control message)

Waiting: spin on the counters (ranks of one step normally arrive within microseconds), then sleep
in the kernel on the late peer's counter with a futex (FUTEX_WAIT on the shared page: it sleeps
only if the counter still holds the value seen, so no wake-up is lost); every publish is followed
by a FUTEX_WAKE on the publisher's counter (one syscall). The spin budget adapts, as an adaptive mutex
does: it doubles (up to ``SPIN_MAX_S``) when the peer arrived while spinning and halves (down to
``SPIN_MIN_S``) when it did not. On a quiet host the ranks run side by side and every wait ends in
the spin (waking a sleeper costs a scheduler round trip, far more than a decode all-reduce on a
VM: benchmarks/README.md, "Figures moved out of the code"); on a host busier
than its cores a spinner burns the time slice its late peer needs, so there the waits go to sleep
almost at once. The gang's control channel uses this too: a follower idling
between requests sleeps in the futex, waking every ``LIVENESS_S`` only to check its peers. Every ``LIVENESS_S`` the waiter checks
that the peers' processes still exist; a dead peer or ``timeout`` without progress raises
``CollectiveError`` naming the peer, and the communicator refuses every later call.

Memory order: the flag is a plain aligned 8-byte store issued after the data copy returned. That
is a release/acquire pair on x86-64 (TSO: stores are seen in order, loads are not reordered with
older loads) but not on weakly ordered CPUs, so ``supported()`` is x86-64 Linux only.

Axes: n elements of a chunk, W ranks, B slot bytes.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import time

import numpy as np
import torch

from workers.errors import DuetError
from workers.parallel.shm_segment import (
    HEADER_LINE, MAGIC, SHM_DIR, SLOT_BYTES, alive, create_segment, data_offset, node_key, pid_namespace, segment_bytes,
    supported)

logger = logging.getLogger(__name__)

SPIN_MAX_S = 1e-3  # spin budget bounds (see "Waiting" above)
SPIN_MIN_S = 10e-6
LIVENESS_S = 0.1  # longest sleep between checks that the late peer still exists

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the waiters are other processes
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall  # ctypes releases the GIL around the call
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int]


def _futex_wake(addr: int) -> None:
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, _INT_MAX, None, None, 0)


def _futex_wait(addr: int, seen: int, seconds: float) -> None:
    """Sleep until woken or ``seconds`` pass, unless the 32-bit word at addr no longer equals seen."""
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, seen & 0xFFFFFFFF, ctypes.byref(ts), None, 0)


class CollectiveError(DuetError, RuntimeError):
    """A shared-memory collective could not complete (a peer died or stopped making progress)."""


class ShmCommunicator:
    """One rank's handle on a group's segment. Not thread-safe: one thread issues the collectives."""

    def __init__(self, path: str, nonce: int, rank: int, world: int, peer_pids: list[int] | None,
                 timeout_s: float, name: str = "") -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, segment_bytes(world))
        finally:
            os.close(fd)
        head = np.frombuffer(self._mm, dtype=np.int64, count=3)
        if head[0] != MAGIC or head[1] != nonce or head[2] != world:
            self._mm.close()
            raise CollectiveError(f"{path}: not the segment of this group (header {head.tolist()})")
        del head
        self.rank, self.world, self.name, self.timeout_s = rank, world, name, timeout_s
        self._pids = peer_pids  # None: peers in another pid namespace, liveness by timeout only
        # [W] sequence counters, one cache line apart
        self._seqs = np.ndarray((world,), dtype=np.int64, buffer=self._mm, offset=HEADER_LINE,
                                strides=(HEADER_LINE,))
        self._addrs = [self._seqs.ctypes.data + HEADER_LINE * r for r in range(world)]  # low 32 bits: the futex word
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=data_offset(world), count=2 * world * SLOT_BYTES)
        self._slots = data.view(2, world, SLOT_BYTES)  # [2, W, B]
        self._typed: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._seq = 0
        self._broken: str | None = None
        self._peers = [r for r in range(world) if r != rank]
        # More ranks than cores: a spinning rank may hold the core its peer needs, so yield at once.
        self._spin_max = SPIN_MAX_S if world <= len(os.sched_getaffinity(0)) else SPIN_MIN_S
        self._spin_s = self._spin_max

    # ---------------------------------------------------------------- plumbing
    def close(self) -> None:
        """Drop the mapping (idempotent). The memory goes when the last rank's mapping does."""
        if self._mm is None:
            return
        self._typed.clear()
        self._slots = self._seqs = None  # type: ignore[assignment]  # closed: every use checks _mm first
        try:
            self._mm.close()
        except BufferError:  # a tensor returned to a caller still views the slots: leave it to the GC
            pass
        self._mm = None  # type: ignore[assignment]  # closed (checked by close and the collectives)
        self._broken = self._broken or "closed"

    def _views(self, buf: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot of buffer ``buf`` as a flat tensor of ``dtype``: W x [B / itemsize]."""
        key = (buf, dtype)
        if key not in self._typed:
            self._typed[key] = [self._slots[buf, r].view(dtype) for r in range(self.world)]
        return self._typed[key]

    def _round(self, chunk: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor]:
        """One round: write ``chunk`` (flat, at most a slot) into this rank's slot, publish, wait for
        every rank; returns every rank's slot views (valid until the round after next)."""
        if self._broken is not None:
            raise CollectiveError(f"shm group {self.name!r} is unusable: {self._broken}")
        seq = self._seq + 1
        views = self._views(seq & 1, dtype)
        if chunk is not None and chunk.numel():
            views[self.rank][: chunk.numel()].copy_(chunk)
        self._seqs[self.rank] = seq  # publish after the copy (x86-64 store order)
        _futex_wake(self._addrs[self.rank])
        self._wait(seq)
        self._seq = seq
        return views

    def _wait(self, seq: int) -> None:
        seqs = self._seqs
        pending = [r for r in self._peers if seqs[r] < seq]
        if not pending:
            return
        t0 = time.monotonic()
        slept = False
        while pending:
            pending = [r for r in pending if seqs[r] < seq]
            if not pending:
                if not slept:  # caught while spinning: the peers run alongside, spinning pays
                    self._spin_s = min(self._spin_max, self._spin_s * 2)
                return
            waited = time.monotonic() - t0
            if waited < self._spin_s:
                continue
            if not slept:  # the spin did not catch the peer: spin less next time
                slept = True
                self._spin_s = max(SPIN_MIN_S, self._spin_s / 2)
            if waited >= LIVENESS_S:
                self._check_peers(pending, seq, waited)
            r = pending[0]
            seen = int(seqs[r])
            if seen < seq:
                _futex_wait(self._addrs[r], seen, LIVENESS_S)

    def _check_peers(self, pending: list[int], seq: int, waited: float) -> None:
        dead = [r for r in pending if self._pids is not None and not alive(self._pids[r])]
        if dead:
            assert self._pids is not None  # dead ranks are found through their pids
            self._broken = f"rank {dead[0]} (pid {self._pids[dead[0]]}) died during collective #{seq}"
        elif waited > self.timeout_s:
            self._broken = (f"rank {pending[0]} did not reach collective #{seq} within {self.timeout_s:.0f} s "
                            "(stuck, or the ranks called different collectives)")
        if self._broken is not None:
            raise CollectiveError(f"shm group {self.name!r} (rank {self.rank}/{self.world}): {self._broken}")

    def _chunks(self, n: int, itemsize: int) -> range:
        return range(0, max(n, 1), SLOT_BYTES // itemsize)

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x is returned). Each rank adds the slots in rank order."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        n, step = flat.numel(), SLOT_BYTES // x.element_size()
        for s in self._chunks(n, x.element_size()):
            part = flat[s : s + step]  # [n]
            views = self._round(part, x.dtype)
            self._sum_into(part, [v[: part.numel()] for v in views])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    @staticmethod
    def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """out = sum of parts in rank order. Two parts: one rounding, as in any backend. More parts of a
        16-bit type are accumulated in fp32 and rounded once (gloo rounds after every addition)."""
        if len(parts) == 2:
            torch.add(parts[0], parts[1], out=out)
            return
        if out.element_size() < 4:
            acc = parts[0].float()
            for p in parts[1:]:
                acc += p
            out.copy_(acc)
            return
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)

    def all_gather(self, x: torch.Tensor, root_only: bool = False) -> list[torch.Tensor] | None:
        """Every rank's x (same shape and dtype on every rank), in rank order; with ``root_only`` only
        rank 0 gets them (None elsewhere)."""
        x = x.contiguous()
        flat = x.view(-1)
        keep = not root_only or self.rank == 0
        outs = [torch.empty_like(flat) for _ in range(self.world)] if keep else None
        step = SLOT_BYTES // x.element_size()
        for s in self._chunks(flat.numel(), x.element_size()):
            part = flat[s : s + step]
            views = self._round(part, x.dtype)
            if outs is not None:
                for r in range(self.world):
                    outs[r][s : s + part.numel()].copy_(views[r][: part.numel()])
        return [o.view_as(x) for o in outs] if outs is not None else None

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Rank ``src``'s bytes on every rank (``data`` is ignored elsewhere). The first round carries
        the length in its first 8 bytes, so every rank knows how many rounds follow."""
        payload = SLOT_BYTES - 8
        if self.rank == src:
            assert data is not None
            head = np.array([len(data)], dtype=np.int64).tobytes()
            buf = torch.frombuffer(bytearray(head + data), dtype=torch.uint8)  # [8 + n]
        else:
            buf = None
        views = self._round(buf[:SLOT_BYTES] if buf is not None else None, torch.uint8)
        n = int(views[src][:8].view(torch.int64).item())
        out = bytearray(n)
        dst = torch.frombuffer(out, dtype=torch.uint8) if n else None  # [n]
        first = min(n, payload)
        if dst is not None:
            dst[:first].copy_(views[src][8 : 8 + first])
        for s in range(first, n, SLOT_BYTES):
            views = self._round(buf[8 + s : 8 + s + SLOT_BYTES] if buf is not None else None, torch.uint8)
            m = min(SLOT_BYTES, n - s)
            assert dst is not None  # n > 0 here
            dst[s : s + m].copy_(views[src][:m])
        return bytes(out)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """x [sum(send_counts), F]: rows [sum(send_counts[:j]), +send_counts[j]) go to rank j; returns
        [sum(recv_counts), F], rank 0's rows for this rank first. Each rank streams its whole x, after
        a header of its send counts (the first round's first ``HEADER_LINE * ceil(W / 8)`` bytes);
        every rank reads the headers and so knows how many rounds the longest stream takes and where
        its rows sit in each peer's stream."""
        w, me = self.world, self.rank
        head = -(-8 * w // HEADER_LINE) * HEADER_LINE
        row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row
        stream = torch.empty(head + x.numel() * x.element_size(), dtype=torch.uint8)  # [H + S row]
        stream[: 8 * w].view(torch.int64).copy_(torch.tensor(send_counts, dtype=torch.int64))
        stream[head:].copy_(x.contiguous().view(-1).view(torch.uint8))
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dst = out.view(-1).view(torch.uint8)  # [R row]
        views = self._round(stream[:SLOT_BYTES], torch.uint8)
        counts = [views[i][: 8 * w].view(torch.int64).tolist() for i in range(w)]  # [W][W]
        assert [c[me] for c in counts] == list(recv_counts), "recv_counts disagree with the peers' send_counts"
        # rank i's rows for me: stream bytes [src[i], src[i] + n[i]); they land at dst [at[i], ...)
        src = [head + sum(c[:me]) * row for c in counts]
        n = [c[me] * row for c in counts]
        at = [sum(n[:i]) for i in range(w)]
        longest = max(head + sum(c) * row for c in counts)
        lo = 0
        while True:
            hi = lo + SLOT_BYTES  # this round carries stream bytes [lo, hi)
            for i in range(w):
                a, b = max(lo, src[i]), min(hi, src[i] + n[i])
                if a < b:
                    dst[at[i] + a - src[i] : at[i] + b - src[i]].copy_(views[i][a - lo : b - lo])
            lo = hi
            if lo >= longest:
                return out
            views = self._round(stream[lo : lo + SLOT_BYTES], torch.uint8)

    def shift(self, x: torch.Tensor, out: torch.Tensor, src: int, max_bytes: int) -> torch.Tensor:
        """Send x to whoever reads this rank, receive rank ``src``'s x into ``out``. Sizes may differ
        per rank; ``max_bytes`` (the largest any rank sends, the same on every rank) fixes the rounds."""
        assert x.dtype == out.dtype
        flat_in = x.contiguous().view(-1)
        flat_out = out.view(-1)
        step = SLOT_BYTES // x.element_size()
        for s in self._chunks(max_bytes // x.element_size(), x.element_size()):
            views = self._round(flat_in[s : s + step], x.dtype)
            dst = flat_out[s : s + step]
            dst.copy_(views[src][: dst.numel()])
        return out


def open_group(pg, rank: int, world: int, name: str, timeout_s: float) -> ShmCommunicator | None:
    """Collective over the torch process group ``pg`` (all ranks of the group call it): a
    communicator if every rank is on this host and can map the segment, else None (every rank
    agrees; the caller keeps the process group's own collectives). The segment file is unlinked
    before this returns, on every path."""
    import torch.distributed as dist

    me = (node_key(), pid_namespace(), os.getpid(), supported())
    peers: list = [None] * world
    dist.all_gather_object(peers, me, group=pg)
    hosts = {p[0] for p in peers}
    if len(hosts) != 1 or not all(p[3] for p in peers):
        why = f"ranks span hosts {sorted(h.split('/')[0] for h in hosts)}" if len(hosts) != 1 \
            else "the host is not x86-64 Linux with /dev/shm"
        log = logger.info if len(hosts) != 1 else logger.warning  # across hosts is the design, not a fallback
        log("group %s: shared-memory collectives off (%s); using %s", name, why, dist.get_backend(pg))
        return None
    pids = [p[2] for p in peers] if len({p[1] for p in peers}) == 1 else None
    path = nonce = None
    comm: ShmCommunicator | None = None
    error = ""
    try:
        if rank == 0:
            try:
                path, nonce = create_segment(world)
            except OSError as e:
                error = f"cannot create a segment in {SHM_DIR}: {e}"
        box = [(path, nonce, error)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        path, nonce, error = box[0]
        if not error:
            assert path is not None and nonce is not None  # rank 0 created the segment
            try:
                comm = ShmCommunicator(path, nonce, rank, world, pids, timeout_s, name)
            except (OSError, CollectiveError) as e:
                error = f"rank {rank} cannot map {path}: {e}"
        errors: list = [None] * world
        dist.all_gather_object(errors, error, group=pg)  # also the barrier after which rank 0 unlinks
    finally:
        if rank == 0 and path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    failed = [e for e in errors if e]
    if failed:
        if comm is not None:
            comm.close()
        logger.warning("group %s: shared-memory collectives off (%s); using %s", name, failed[0], dist.get_backend(pg))
        return None
    return comm
