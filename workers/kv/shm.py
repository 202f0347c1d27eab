"""The shared-memory KV transport: one pair's ordered message stream through a ring in /dev/shm,
for a prefill (sending) and a decode (receiving) worker on the same host (workers/kv/transfer.py
picks it; the wire format is workers/kv/wire.py).

Why. Over gloo, KV between two processes of one host goes through loopback TCP: the kernel copies
every byte twice and the stream is cut into small packets. Through a shared ring the sender copies
each byte once into memory the receiver maps, and the receiver copies it once out, in large chunks
that run side by side (the sender fills chunk k + 1 while the receiver drains chunk k). A KV
payload goes as a *block stream* (``send_blocks`` / ``recv_blocks``): block by block, each copied
straight from the sender's tensor into the ring and hashed there while its bytes are still in the
CPU cache, then copied out into the receiver's tensor and hashed again from the ring, so the
per-block checksums (workers/kv/wire.py) cost no extra pass over memory on either side.

Terms:
    segment   one file per pair under /dev/shm (``duet-shm-<creator pid>-kv-<random>``), created by
              the receiving side, mapped by both and **unlinked as soon as the sender has mapped it**
              (the handshake), so no file outlives the pair whatever happens to the processes later;
              the kernel frees the memory with the last mapping. A file whose creator died before the
              handshake ended is removed by the next ``sweep_stale`` (workers/parallel/shm_segment.py).
    ring      the segment's data area, ``capacity`` bytes used as a byte stream: the sender owns
              ``written`` (bytes produced so far), the receiver ``read`` (bytes consumed); each sits
              on its own cache line. The sender writes while written - read < capacity, the receiver
              reads while read < written. A message is a 16-byte frame (tag, length) then its bytes.
    handshake over the pair's store (the decode worker's TCPStore): the receiver publishes
              ``shm/offer`` (path, nonce, host id, pid); the sender checks the host id is its own
              (else: a clear error naming ``kv_transfer_backend``), maps the file, checks the nonce
              in its header and answers ``shm/attached`` (its pid); the receiver then unlinks it.

Waiting: a short spin, then a futex sleep on the peer's counter (the same primitives as the
shared-memory collectives, workers/parallel/shm_comm.py), waking every ``LIVENESS_S`` to check that
the peer process still exists and has not closed its end. A dead peer, a closed end or no progress
for ``timeout_s`` raises KVTransferError. Memory order: counters are plain aligned 8-byte stores
after the copy (release/acquire on x86-64, which ``supported()`` requires); the per-block checksums
would still catch torn data.

Worked example (two processes, the store shared)::

    ring = offer_ring(store, timeout_s=30)            # receiver (rank 1): blocks until attached
    ring = attach_ring(store, timeout_s=30)           # sender (rank 0)
    ring.send(torch.arange(4), tag=1)                  # sender
    out = torch.empty(4, dtype=torch.int64); ring.recv(out, tag=1)   # receiver
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import time
from datetime import timedelta

import numpy as np
import torch
import xxhash

from workers.kv.wire import KVTransferError, signed64
from workers.parallel.shm_comm import LIVENESS_S, _futex_wait, _futex_wake
from workers.parallel.shm_segment import PREFIX, SHM_DIR, alive, node_key, pid_namespace, supported, sweep_stale

RING_MAGIC = 0x4455_4554_4B56_5348  # "DUETKVSH"
DEFAULT_CAPACITY = 32 << 20  # ring bytes per pair
CHUNK = 4 << 20  # most bytes copied per counter update (so the two sides overlap)
ALIGN = 64  # a block of a block stream starts on a cache line
_LINE = 64
_WRITTEN, _READ, _SENDER_CLOSED, _RECEIVER_CLOSED = 1, 2, 3, 4  # header lines (int64 each)
_DATA = 4096  # data offset (page aligned)
SPIN_S = 50e-6
SLEEP_S = 2e-3  # longest futex sleep mid-transfer (the peer's wake normally ends it sooner)


def same_host_possible() -> bool:
    """Whether this process can use the shared-memory transport at all (x86-64 Linux with /dev/shm)."""
    return supported()


class ShmRing:
    """One side of a pair's ring (rank 0 sends, rank 1 receives). Not thread-safe: one transfer at a
    time, as the pair's lock guarantees."""

    def __init__(self, path: str, nonce: int, capacity: int, rank: int, timeout_s: float) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, _DATA + capacity)
        finally:
            os.close(fd)
        head = np.frombuffer(self._mm, dtype=np.int64, count=3)
        if head[0] != RING_MAGIC or head[1] != nonce or head[2] != capacity:
            del head
            self._mm.close()
            raise KVTransferError(f"{path}: not this pair's shared-memory segment")
        del head
        self.path, self.nonce, self.rank, self.capacity, self.timeout_s = path, nonce, rank, capacity, timeout_s
        # [5] one counter per cache line: magic line, written, read, sender closed, receiver closed
        self._lines = np.ndarray((5,), dtype=np.int64, buffer=self._mm, offset=0, strides=(_LINE,))
        self._addr = [self._lines.ctypes.data + _LINE * i for i in range(5)]
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_DATA, count=capacity)
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8, offset=_DATA, count=capacity)  # for hashing
        self.peer_pid: int | None = None  # None: another pid namespace, liveness by timeout only

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, capacity: int, timeout_s: float) -> ShmRing:
        """A fresh segment (the receiving side). The caller unlinks ``ring.path`` after the handshake."""
        sweep_stale()
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-kv-{secrets.token_hex(6)}")
        nonce = secrets.randbits(63)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _DATA + capacity)
            try:  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS on a later write
                os.posix_fallocate(fd, 0, _DATA + capacity)
            except OSError as e:
                raise KVTransferError(f"cannot reserve {(_DATA + capacity) >> 20} MiB in {SHM_DIR} for the KV ring "
                                      f"({e}); give /dev/shm more room or set kv_transfer_backend to gloo") from None
            with mmap.mmap(fd, _LINE) as mm:
                mm[:24] = np.array([RING_MAGIC, nonce, capacity], dtype=np.int64).tobytes()
            ring = cls(path, nonce, capacity, 1, timeout_s)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return ring

    def mark_closed(self) -> None:
        """Tell the peer this end is closed (its next wait fails at once); any thread. Idempotent."""
        lines = self._lines
        if lines is None:
            return
        lines[_SENDER_CLOSED if self.rank == 0 else _RECEIVER_CLOSED] = 1
        _futex_wake(self._addr[_WRITTEN if self.rank == 0 else _READ])

    def close(self) -> None:
        """Mark this end closed and unmap; only from the thread that sends / receives. Idempotent."""
        if self._mm is None:
            return
        self.mark_closed()
        self._lines = self._data = self._bytes = None  # type: ignore[assignment]  # closed: released
        try:
            self._mm.close()
        except BufferError:  # a received tensor never views the ring (it is copied out): should not happen
            pass
        self._mm = None  # type: ignore[assignment]  # closed: released

    @property
    def closed(self) -> bool:
        return self._mm is None

    # ------------------------------------------------------------------ messages
    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Rank 0: one message (a CPU tensor, any dtype) into the stream; blocks while the ring is full."""
        src = tensor.contiguous().view(-1).view(torch.uint8)
        self._write(torch.tensor([tag, src.numel()], dtype=torch.int64).view(torch.uint8))
        self._write(src)

    def recv(self, out: torch.Tensor, tag: int) -> None:
        """Rank 1: the next message into ``out`` (contiguous CPU tensor of the message's exact size)."""
        assert out.is_contiguous()
        frame = torch.empty(2, dtype=torch.int64)
        self._read(frame.view(torch.uint8))
        if frame.tolist() != [tag, out.nbytes]:
            raise KVTransferError(f"shm stream out of sync: frame {frame.tolist()}, expected tag {tag} "
                                  f"with {out.nbytes} bytes")
        self._read(out.view(-1).view(torch.uint8))

    # ------------------------------------------------------------------ block streams
    def send_blocks(self, kv: torch.Tensor, tag: int) -> list[int]:
        """Rank 0: kv [L, 2, n, ...] (CPU) as one message, block by block: block i is the L * 2
        pieces ``kv[:, :, i]`` in order, copied straight from ``kv`` into the ring (no staging copy)
        and hashed there with XXH3-64 right after, while its bytes are still in the cache (the value
        ``block_checksums`` gives for that block). Returns the n hashes (signed, as on the wire).
        A block larger than a quarter of the ring goes through a staging copy and the byte stream.
        Copies are numpy's (one thread, a memmove per contiguous run): torch's parallel strided copy
        is much slower for these shapes when the cores are busy."""
        blocks, shape, nb, staged = self._block_stream(kv)
        n = blocks.shape[2]
        self._write(torch.tensor([tag, n * nb], dtype=torch.int64).view(torch.uint8))
        hashes = []
        for i in range(n):
            if staged:
                stage = np.ascontiguousarray(blocks[:, :, i]).reshape(-1)
                hashes.append(signed64(xxhash.xxh3_64_intdigest(stage)))  # type: ignore[arg-type]  # an ndarray is a buffer
                self._write(torch.from_numpy(stage))
                continue
            pos, step = self._claim(nb, for_write=True)
            ring = self._bytes[pos : pos + nb]
            np.copyto(ring.reshape(shape), blocks[:, :, i])
            hashes.append(signed64(xxhash.xxh3_64_intdigest(ring)))  # type: ignore[arg-type]  # an ndarray is a buffer
            self._lines[_WRITTEN] += step  # publish after the copy (x86-64 store order)
            _futex_wake(self._addr[_WRITTEN])
        return hashes

    def recv_blocks(self, out: torch.Tensor, tag: int) -> list[int]:
        """Rank 1: the next message, sent by ``send_blocks``, into ``out`` [L, 2, n, ...] (CPU):
        each block is copied out of the ring into ``out[:, :, i]`` and the ring's bytes of it are
        hashed right after, before the sender may reuse them. Returns the n hashes of what arrived."""
        blocks, shape, nb, staged = self._block_stream(out)
        n = blocks.shape[2]
        frame = torch.empty(2, dtype=torch.int64)
        self._read(frame.view(torch.uint8))
        if frame.tolist() != [tag, n * nb]:
            raise KVTransferError(f"shm stream out of sync: frame {frame.tolist()}, expected tag {tag} "
                                  f"with {n * nb} bytes")
        hashes = []
        stage = np.empty(nb, dtype=np.uint8) if staged else None
        for i in range(n):
            if stage is not None:
                self._read(torch.from_numpy(stage))
                hashes.append(signed64(xxhash.xxh3_64_intdigest(stage)))  # type: ignore[arg-type]  # an ndarray is a buffer
                np.copyto(blocks[:, :, i], stage.reshape(shape))
                continue
            pos, step = self._claim(nb, for_write=False)
            ring = self._bytes[pos : pos + nb]
            np.copyto(blocks[:, :, i], ring.reshape(shape))
            hashes.append(signed64(xxhash.xxh3_64_intdigest(ring)))  # type: ignore[arg-type]  # an ndarray is a buffer
            self._lines[_READ] += step  # the bytes are ours: the sender may overwrite them
            _futex_wake(self._addr[_READ])
        return hashes

    def _block_stream(self, kv: torch.Tensor) -> tuple[np.ndarray, tuple[int, ...], int, bool]:
        """kv [L, 2, n, ...] (CPU, last dim contiguous) -> (its uint8 numpy view [L, 2, n, ...,
        D * itemsize], one block's shape in that view, one block's bytes, whether blocks go through
        a staging copy: those larger than a quarter of the ring)."""
        blocks = kv.view(torch.uint8).numpy()  # any dtype, bfloat16 included: the last dim counts bytes
        one = blocks[:, :, 0]
        return blocks, one.shape, one.size, one.size > self.capacity // 4

    def _claim(self, nb: int, for_write: bool) -> tuple[int, int]:
        """The ring position of the next block of ``nb`` bytes of a block stream and the counter step
        that passes it, after waiting until the ring has room (sender) or holds it (receiver). Both
        sides skip the same bytes: up to the next cache line, or to the ring's start when the block
        would not fit before its end (so each block is one contiguous piece of the ring)."""
        lines, cap = self._live(), self.capacity
        at = int(lines[_WRITTEN if for_write else _READ])
        pos = at % cap
        pad = -pos % ALIGN
        if pos + pad + nb > cap:
            pad = cap - pos
        step = pad + nb
        if for_write:
            if cap - (at - int(lines[_READ])) < step:
                self._wait(_READ, int(lines[_READ]), lambda: cap - (at - int(lines[_READ])) >= step)
        elif int(lines[_WRITTEN]) - at < step:
            self._wait(_WRITTEN, int(lines[_WRITTEN]), lambda: int(lines[_WRITTEN]) - at >= step)
        return (pos + pad) % cap, step

    def _write(self, src: torch.Tensor) -> None:
        lines, cap = self._live(), self.capacity
        off, n = 0, src.numel()
        while off < n:
            written = int(lines[_WRITTEN])
            free = cap - (written - int(lines[_READ]))
            if free == 0:
                self._wait(_READ, int(lines[_READ]), lambda: cap - (int(lines[_WRITTEN]) - int(lines[_READ])) > 0)
                continue
            pos = written % cap
            k = min(n - off, free, cap - pos, CHUNK)
            self._data[pos : pos + k].copy_(src[off : off + k])
            lines[_WRITTEN] = written + k  # publish after the copy (x86-64 store order)
            _futex_wake(self._addr[_WRITTEN])
            off += k

    def _read(self, dst: torch.Tensor) -> None:
        lines, cap = self._live(), self.capacity
        off, n = 0, dst.numel()
        while off < n:
            read = int(lines[_READ])
            avail = int(lines[_WRITTEN]) - read
            if avail == 0:
                self._wait(_WRITTEN, int(lines[_WRITTEN]), lambda: int(lines[_WRITTEN]) > int(lines[_READ]))
                continue
            pos = read % cap
            k = min(n - off, avail, cap - pos, CHUNK)
            dst[off : off + k].copy_(self._data[pos : pos + k])
            lines[_READ] = read + k  # the bytes are ours: the sender may overwrite them
            _futex_wake(self._addr[_READ])
            off += k

    def _live(self) -> np.ndarray:
        if self._mm is None:
            raise KVTransferError("shm ring closed")
        return self._lines

    def _wait(self, line: int, seen: int, ready) -> None:
        """Until ready(): spin, then futex-sleep on the peer's counter ``line`` (value ``seen``)."""
        t0 = last = time.monotonic()
        lines = self._lines
        while not ready():
            now = time.monotonic()
            if lines[_SENDER_CLOSED if self.rank == 1 else _RECEIVER_CLOSED]:
                raise KVTransferError("the peer closed its end of the shm ring (it dropped the pair)")
            if now - t0 < SPIN_S:
                continue
            if now - last >= LIVENESS_S:
                last = now
                if self.peer_pid is not None and not alive(self.peer_pid):
                    raise KVTransferError(f"the peer process (pid {self.peer_pid}) died mid-transfer")
                if now - t0 > self.timeout_s:
                    raise KVTransferError(f"no progress on the shm ring for {self.timeout_s:g} s (peer stalled)")
            _futex_wait(self._addr[line], seen, SLEEP_S)  # short: a wake-up the kernel misses costs little
            seen = int(lines[line])


# ---------------------------------------------------------------------- handshake
def offer_ring(store, timeout_s: float, capacity: int | None = None) -> ShmRing:
    """Receiving side: create the segment (``capacity`` ring bytes, default DEFAULT_CAPACITY), offer
    it on ``store`` and wait for the sender to map it; the file is unlinked on every path out of
    here. Raises KVTransferError."""
    ring = ShmRing.create(capacity or DEFAULT_CAPACITY, timeout_s)
    try:
        store.set("shm/offer", json.dumps({"path": ring.path, "nonce": ring.nonce, "host": node_key(),
                                           "pidns": pid_namespace(), "pid": os.getpid()}))
        try:
            store.wait(["shm/attached"], timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise KVTransferError(f"the sender did not map the shm segment within {timeout_s:g} s ({e})") from None
        answer = json.loads(store.get("shm/attached"))
        if "error" in answer:
            raise KVTransferError(answer["error"])
        if answer["pidns"] == pid_namespace():
            ring.peer_pid = int(answer["pid"])
        return ring
    except BaseException:
        ring.close()
        raise
    finally:
        os.unlink(ring.path)


def attach_ring(store, timeout_s: float) -> ShmRing:
    """Sending side: map the receiver's offered segment (same host only). Raises KVTransferError."""
    try:
        store.wait(["shm/offer"], timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise KVTransferError(f"the receiver offered no shm segment within {timeout_s:g} s ({e})") from None
    offer = json.loads(store.get("shm/offer"))
    error = None
    if offer["host"] != node_key():
        error = (f"kv_transfer_backend 'shm' needs both workers on one host: the receiver is on {offer['host']!r}, "
                 f"this sender on {node_key()!r}; use 'gloo' (or 'auto')")
    elif not same_host_possible():
        error = "kv_transfer_backend 'shm' is not supported on this host (x86-64 Linux with /dev/shm); use 'gloo'"
    ring = None
    if error is None:
        try:
            ring = ShmRing(offer["path"], int(offer["nonce"]), _capacity_of(offer["path"]), 0, timeout_s)
        except (OSError, KVTransferError) as e:
            error = f"could not map the receiver's shm segment {offer['path']}: {e}"
    if error is not None:
        store.set("shm/attached", json.dumps({"error": error}))
        raise KVTransferError(error)
    assert ring is not None  # mapped, or error was set
    if offer["pidns"] == pid_namespace():
        ring.peer_pid = int(offer["pid"])
    store.set("shm/attached", json.dumps({"pid": os.getpid(), "pidns": pid_namespace()}))
    return ring


def _capacity_of(path: str) -> int:
    return os.stat(path).st_size - _DATA
