"""KV-cache transfer between a sending worker (prefill, or a prefix holder) and a receiving one
(decode, or a prefix puller): pairs, their ordered transfer streams, and the transports under them.

Terms:
    pair        one (sender, receiver) couple. It owns a 2-rank channel: rank 0 = the sender (the
                ``prefill_*`` fields of its key), rank 1 = the receiver (``decode_*``). Built lazily
                on first use, straight from a store (no global ``init_process_group``), so any
                number of pairs coexist in one process and a third worker joining or leaving never
                touches an existing pair's channel.
    store       the receiver hosts a ``TCPStore`` server (``KVReceiver.address``); the sender dials it
                when a request names it. Each pair rendezvouses under its own ``PrefixStore(pair_key)``.
    pair key    ``kv/<sender id>/<sender incarnation>/<receiver id>/<receiver incarnation>/<generation>``
                (+ ``/shm`` for a shared-memory pair): a restarted worker (new incarnation) or a pair
                dropped after a failure (generation + 1, chosen by the receiver) always rendezvouses
                afresh, never reusing a stale channel.
    transfer    the KV of one request's blocks, identified by a transfer id the receiver chose when it
                reserved the blocks. Three messages on the pair's channel: header, per-block
                checks, payload (the format, checksums and model fingerprint: workers/kv/wire.py).
                The receiver checks the header (layout and model fingerprint against its own), the
                transfer id, first block and count against the reservation, then recomputes every
                checksum; only a transfer that passes every check is handed on (``ReceivedKV``).

Modules: this one holds the public API (KVSender, KVReceiver, PairKey, ReceivedKV); a pair's
channel and the backend choice are workers/kv/channel.py, the wire format workers/kv/wire.py, the
shared-memory ring workers/kv/shm.py.

Transports (``kv_transfer_backend``, one of KV_BACKENDS; the receiver picks it and names it in
the request):
    shm         a ring in shared memory (workers/kv/shm.py): both workers on one host, host memory.
    gloo        a 2-rank gloo group over TCP: any two hosts; a CUDA cache stages through pinned host
                memory on either side (device -> pinned buffer -> gloo -> pinned buffer -> device).
    nccl        a 2-rank NCCL group: GPU blocks GPU to GPU (both caches on CUDA).
    auto        per peer: shm when the peer is on this host (its endpoint's address is this worker's,
                or both are loopback), this worker's cache is on the CPU and the host supports it;
                otherwise nccl when the cache is on CUDA, else gloo (``choose_backend``).
A sender serves any shm or gloo request and an nccl one only from a CUDA cache; a shm request from
another host fails its handshake with an error naming the setting.

Ordering. Transfers on one pair form one ordered stream: the sender holds the pair's lock from
announcement to payload; before each transfer it *announces* it in the pair's store (key
``announce/<n>`` = transfer id, n = 1, 2, ...). The receiver runs one receive loop per pair (on
the pair's own thread) that waits for announcement n, reads that whole transfer, dispatches it by
transfer id to whoever expects it (or discards it: the request ended meanwhile) and moves to n + 1.
So concurrent requests on one pair may complete in any order, a request that gives up never
desynchronises the stream (its transfer is still read, then dropped), and no receive is posted for
a transfer that was never started. A peer that dies mid-transfer shows as an error at once (gloo
sees the closed connection; the shm ring checks the peer process), a silent one as a timeout.

Failure: any error on a pair (timeout, closed peer, bad header, another model, checksum mismatch)
fails the transfer(s) involved with ``KVTransferError`` and drops the pair's channel on that side;
the receiver bumps the pair generation so the next request rendezvouses a new channel.

Heads: a transfer always carries every kv head of the model (``KVLayout.num_kv_heads``), whatever
the parallel shapes of the two workers: a gang's runner gathers its ranks' head shards before a
send and scatters them after a receive (workers/engine/gang_runner.py). Both sides check it.

Axes: L layers, n blocks in the transfer, bs block size, G kv heads, D head dim.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch.distributed import TCPStore

from workers.config import KV_BACKENDS  # noqa: F401 - kv_transfer_backend's one definition, re-exported
from workers.kv.buffers import RecvBuffers
from workers.kv.channel import (PairChannel, PairKey, check_kv_backend, choose_backend,  # noqa: F401 - public API
                                resolve_kv_backend, same_host)
from workers.kv.wire import KVTransferError, block_checksums, verify  # noqa: F401 - public API
from workers.engine.runner import KVLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceivedKV:
    """A verified transfer: ``kv`` [L, 2, n, bs, G, D] for logical blocks first_block.. of the request."""

    transfer_id: str
    first_block: int
    kv: torch.Tensor
    num_bytes: int
    seconds: float


@dataclass
class TransferStats:
    """Counters since the worker started (exported in LoadReport)."""

    bytes_sent: int = 0
    transfers_sent: int = 0
    bytes_received: int = 0
    transfers_received: int = 0
    failures: int = 0
    seconds: float = 0.0  # wall time spent sending or receiving payloads


class KVSender:
    """Sending side: one PairChannel per receiving worker, rebuilt when the pair key changes.

    ``send`` is blocking (run it on a thread); it builds the pair's channel on first use, which
    waits for the receiver to join the rendezvous (bounded by ``timeout_s``). backend: 'gloo',
    'nccl' or 'shm' (one sender per backend). fingerprint: this worker's model fingerprint
    (workers/engine/runner.py ``kv_fingerprint``); the receiver refuses a transfer with another one."""

    def __init__(self, layout: KVLayout, backend: str = "gloo", timeout_s: float = 30.0,
                 fingerprint: int = 0) -> None:
        self.layout = layout
        self.backend = backend
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._channels: dict[str, Future[PairChannel]] = {}  # decode id -> channel being built / built
        self._stores: dict[str, TCPStore] = {}  # store address -> client

    def channel(self, key: PairKey, store_address: str) -> Future[PairChannel]:
        """The pair's channel (built on a thread if new); a changed key drops the old one."""
        with self._lock:
            old = self._channels.get(key.decode_id)
            if old is not None and getattr(old, "key", None) == key:
                return old
            fut: Future[PairChannel] = Future()
            fut.key = key  # type: ignore[attr-defined]
            self._channels[key.decode_id] = fut
        _close_channel(old)
        threading.Thread(target=self._build, args=(fut, key, store_address), daemon=True,
                         name=f"kv-pair-{key.decode_id}").start()
        return fut

    def _build(self, fut: Future, key: PairKey, address: str) -> None:
        try:
            store = self._store(address)
            fut.set_result(PairChannel(key, store, 0, self.timeout_s, self.backend, fingerprint=self.fingerprint))
            logger.info("kv pair %s: group ready (prefill side)", key.prefix)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.drop(key)
            fut.set_exception(KVTransferError(f"pair {key.prefix}: could not join ({e})"))

    def _store(self, address: str) -> TCPStore:
        with self._lock:
            store = self._stores.get(address)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=self.timeout_s))
            with self._lock:
                store = self._stores.setdefault(address, store)
        return store

    def drop(self, key: PairKey) -> None:
        with self._lock:
            fut = self._channels.get(key.decode_id)
            if fut is not None and getattr(fut, "key", None) == key:
                del self._channels[key.decode_id]
            else:
                fut = None
        _close_channel(fut)

    def send(self, channel: PairChannel, transfer_id: str, first_block: int, kv: torch.Tensor) -> int:
        """Blocking. Returns the bytes sent; raises KVTransferError (and drops the pair) on failure."""
        start = time.monotonic()
        try:
            with channel.lock:
                n = channel.send(self.layout, transfer_id, first_block, kv)
        except BaseException as e:
            self.stats.failures += 1
            self.drop(channel.key)
            raise KVTransferError(f"sending {transfer_id} on {channel.key.prefix} failed: {e}") from e
        dt = time.monotonic() - start
        s = self.stats
        s.bytes_sent, s.transfers_sent, s.seconds = s.bytes_sent + n, s.transfers_sent + 1, s.seconds + dt
        logger.info("kv transfer %s sent: %d blocks, %.2f MB in %.1f ms (%.0f MB/s)", transfer_id, kv.shape[2],
                    n / 1e6, dt * 1e3, n / 1e6 / max(dt, 1e-9))
        return n


def _close_channel(fut: Future | None) -> None:
    if fut is not None and fut.done() and fut.exception() is None:
        fut.result().close()


@dataclass
class _Expected:
    key: PairKey
    first_block: int
    num_blocks: int
    future: Future  # Future[ReceivedKV]


class KVReceiver:
    """Decode side: hosts the store, builds one PairChannel per prefill worker, verifies transfers.

    Use (per request): ``key = pair_key(prefill id, incarnation)``; ``expect(key, tid, first_block,
    n)`` -> a Future; ``channel(key)`` (starts the rendezvous and, once the group is up, the pair's
    receive loop). The Future then holds the verified ``ReceivedKV`` or a KVTransferError.
    ``cancel(tid)`` when the request ends first (its transfer, if it comes, is read and discarded).
    """

    def __init__(self, layout: KVLayout, worker_id: str, incarnation: str, host: str = "127.0.0.1",
                 backend: str = "gloo", timeout_s: float = 30.0, fingerprint: int = 0) -> None:
        """backend: 'gloo' or 'nccl', for pairs whose key names none; a key with backend 'shm'
        (``pair_key(..., backend="shm")``) gets a shared-memory ring. fingerprint: as KVSender's."""
        self.layout = layout
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.backend = backend
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self.store = TCPStore(host.strip("[]"), 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self._host = host.strip("[]")
        self.address = f"[{host}]:{self.store.port}" if ":" in host else f"{host}:{self.store.port}"
        self._lock = threading.Lock()
        self._generations: dict[tuple[str, str, str], int] = {}
        self._channels: dict[PairKey, Future[PairChannel]] = {}
        self._expected: dict[str, _Expected] = {}
        self.buffers = RecvBuffers()  # payload buffers, reused once their consumer dropped them

    def pair_key(self, prefill_id: str, prefill_incarnation: str, backend: str | None = None) -> PairKey:
        """The current key of the pair with this sender; backend 'shm' for a shared-memory pair
        (None or this receiver's own backend: the default gloo/nccl pair)."""
        shm = "shm" if backend == "shm" else ""
        with self._lock:
            gen = self._generations.setdefault((prefill_id, prefill_incarnation, shm), 0)
        return PairKey(prefill_id, prefill_incarnation, self.worker_id, self.incarnation, gen, shm)

    def channel(self, key: PairKey) -> Future[PairChannel]:
        with self._lock:
            fut = self._channels.get(key)
            if fut is not None:
                return fut
            fut = self._channels[key] = Future()
        threading.Thread(target=self._build, args=(fut, key), daemon=True, name=f"kv-pair-{key.prefill_id}").start()
        return fut

    def _build(self, fut: Future, key: PairKey) -> None:
        try:
            waiter = TCPStore(self._host, self.store.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
            channel = PairChannel(key, self.store, 1, self.timeout_s, key.backend or self.backend, wait_store=waiter,
                                  fingerprint=self.fingerprint, buffers=self.buffers)
            channel.executor.submit(channel.receive_loop, self.layout, lambda *a: self._deliver(key, *a),
                                    lambda e: self._drop(key, f"receive failed: {e}"))
            fut.set_result(channel)
            logger.info("kv pair %s: group ready (decode side)", key.prefix)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self._drop(key, f"could not build the group: {e}")
            if not fut.done():
                fut.set_exception(KVTransferError(f"pair {key.prefix}: rendezvous failed ({e})"))

    def expect(self, key: PairKey, transfer_id: str, first_block: int, num_blocks: int) -> Future:
        fut: Future = Future()
        with self._lock:
            assert transfer_id not in self._expected, f"transfer {transfer_id} expected twice"
            self._expected[transfer_id] = _Expected(key, first_block, num_blocks, fut)
        return fut

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            self._expected.pop(transfer_id, None)

    def _deliver(self, key: PairKey, tid: str, first: int, checks: torch.Tensor, kv: torch.Tensor, nbytes: int,
                 dt: float, hashes: list[int] | None = None) -> None:
        """The receive loop's hand-off: verify a transfer and settle its Future (or discard it)."""
        with self._lock:
            exp = self._expected.pop(tid, None)
        if exp is None:
            logger.info("kv transfer %s arrived but is no longer expected (request ended); discarded", tid)
            return
        problem = self._verify(exp, key, first, checks, kv, hashes)
        if problem is not None:
            logger.warning("kv transfer %s rejected: %s", tid, problem)
            exp.future.set_exception(KVTransferError(f"transfer {tid} rejected: {problem}"))
            self._drop(key, f"transfer {tid} failed verification")
            return
        s = self.stats
        s.bytes_received, s.transfers_received, s.seconds = s.bytes_received + nbytes, s.transfers_received + 1, \
            s.seconds + dt
        logger.info("kv transfer %s received: %d blocks, %.2f MB in %.1f ms", tid, kv.shape[2], nbytes / 1e6, dt * 1e3)
        exp.future.set_result(ReceivedKV(tid, first, kv, nbytes, dt))

    @staticmethod
    def _verify(exp: _Expected, key: PairKey, first: int, checks: torch.Tensor, kv: torch.Tensor,
                hashes: list[int] | None) -> str | None:
        n = kv.shape[2]
        if exp.key != key:
            return f"arrived on pair {key.prefix}, expected on {exp.key.prefix}"
        if first != exp.first_block or n != exp.num_blocks:
            return f"blocks {first}..{first + n - 1} sent, {exp.first_block}..{exp.first_block + exp.num_blocks - 1} reserved"
        return verify(checks, kv, first, hashes)

    def _drop(self, key: PairKey, why: str) -> None:
        """Forget the pair's group (next generation) and fail every transfer expected on it."""
        with self._lock:
            _close_channel(self._channels.pop(key, None))
            ident = (key.prefill_id, key.prefill_incarnation, key.backend)
            if self._generations.get(ident) == key.generation:
                self._generations[ident] = key.generation + 1
            failed = [tid for tid, e in self._expected.items() if e.key == key]
            expected = [self._expected.pop(tid) for tid in failed]
        self.stats.failures += 1
        logger.warning("kv pair %s dropped (%s); %d transfer(s) failed", key.prefix, why, len(expected))
        for e in expected:
            if not e.future.done():
                e.future.set_exception(KVTransferError(f"pair {key.prefix} dropped: {why}"))

    def close(self) -> None:
        with self._lock:
            for fut in self._channels.values():
                _close_channel(fut)
            self._channels.clear()
            expected, self._expected = list(self._expected.values()), {}
        self.buffers.clear()
        for e in expected:
            if not e.future.done():
                e.future.set_exception(KVTransferError("receiver closed"))
