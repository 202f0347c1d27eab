"""One pair's channel: the ordered stream of transfers between a sending and a receiving worker,
over the transport the receiver chose (workers/kv/transfer.py explains pairs, keys, ordering and
backends; the wire format is workers/kv/wire.py, the shared-memory ring workers/kv/shm.py).

Axes: L layers, n blocks in the transfer, bs block size, G kv heads, D head dim.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import threading
import time
from typing import Any
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from workers.config import KV_BACKENDS
from workers.kv.buffers import RecvBuffers
from workers.kv.shm import ShmRing, attach_ring, offer_ring, same_host_possible
from workers.kv.wire import HEADER_WORDS, KVTransferError, checks_of, decode_header, encode_header
from workers.engine.runner import KVLayout

logger = logging.getLogger(__name__)

_TAG_HEADER, _TAG_CHECKS, _TAG_PAYLOAD = 1, 2, 3

def check_kv_backend(requested: object) -> str:
    """Validate a ``kv_transfer_backend`` value at the edge; raises ValueError naming the setting."""
    if requested not in KV_BACKENDS:
        raise ValueError(f"kv_transfer_backend={requested!r}: must be one of {', '.join(KV_BACKENDS)}")
    return requested


def resolve_kv_backend(requested: str, device: str) -> str:
    """``kv_transfer_backend`` for a worker whose cache is on ``device`` -> its channel backend for
    peers on other hosts: 'nccl' or 'gloo' (shm is decided per peer: ``choose_backend``)."""
    check_kv_backend(requested)
    on_cuda = device.startswith("cuda")
    if requested == "nccl" and not on_cuda:
        raise ValueError(f"kv_transfer_backend='nccl' needs the KV cache on CUDA (device={device!r}); use gloo or auto")
    if requested in ("auto", "shm"):
        return "nccl" if on_cuda and requested == "auto" else "gloo"
    return requested


def _host_of(endpoint: str) -> str:
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
    return host.strip("[]")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def same_host(peer_endpoint: str, own_host: str) -> bool:
    """Whether a peer at ``peer_endpoint`` (host:port) runs on this worker's host (bound to
    ``own_host``): the same address, or both loopback. The shm handshake checks it for real."""
    peer = _host_of(peer_endpoint)
    if not peer:
        return False
    if peer == own_host or (_is_loopback(peer) and _is_loopback(own_host)):
        return True
    try:
        return socket.gethostbyname(peer) == socket.gethostbyname(own_host)
    except OSError:
        return False


def choose_backend(requested: str, device: str, peer_endpoint: str, own_host: str) -> str:
    """The backend for KV this worker receives from the peer at ``peer_endpoint``:
    'shm' | 'gloo' | 'nccl' (see the module docstring for ``auto``)."""
    base = resolve_kv_backend(requested, device)
    if requested == "shm":
        return "shm"
    if requested == "auto" and not device.startswith("cuda") and same_host_possible() \
            and same_host(peer_endpoint, own_host):
        return "shm"
    return base


def _staged(kv: torch.Tensor) -> torch.Tensor:
    """kv in host memory for gloo / shm: a CUDA tensor goes through a pinned buffer (one DMA copy)."""
    if not kv.is_cuda:
        return kv.contiguous()
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    host.copy_(kv)  # blocking: the buffer is complete before it is read
    return host


@dataclass(frozen=True)
class PairKey:
    """Identity of one pair's channel (see the module docstring). backend: "shm" for a
    shared-memory pair, "" for the receiver's own gloo/nccl backend."""

    prefill_id: str
    prefill_incarnation: str
    decode_id: str
    decode_incarnation: str
    generation: int
    backend: str = ""

    @property
    def prefix(self) -> str:
        base = (f"kv/{self.prefill_id}/{self.prefill_incarnation}/{self.decode_id}/"
                f"{self.decode_incarnation}/{self.generation}")
        return f"{base}/{self.backend}" if self.backend else base


class _GroupTransport:
    """Messages over a 2-rank torch.distributed group (gloo or NCCL)."""

    def __init__(self, group, timeout: datetime.timedelta, key: PairKey) -> None:
        self.group, self.timeout, self.key = group, timeout, key

    def _wait(self, work) -> None:
        if not work.wait(self.timeout):
            raise KVTransferError(f"pair {self.key.prefix}: timed out after {self.timeout.total_seconds():g} s")

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self.finish(self.start_send(tensor, tag))

    def start_send(self, tensor: torch.Tensor, tag: int):
        """Begin sending (the group's own threads move the bytes); ``finish`` waits for it."""
        return self.group.send([tensor], 1, tag)

    def finish(self, work) -> None:
        self._wait(work)

    def recv(self, out: torch.Tensor, tag: int) -> None:
        self._wait(self.group.recv([out], 0, tag))

    def close(self) -> None:
        pass


class PairChannel:
    """One pair's channel. Blocking methods: call them from a thread, not an event loop."""

    def __init__(self, key: PairKey, store: TCPStore, rank: int, timeout_s: float, backend: str,
                 wait_store: TCPStore | None = None, fingerprint: int = 0,
                 buffers: RecvBuffers | None = None) -> None:
        """wait_store (rank 1): a store client of its own for the receive loop's blocking waits (a
        client serialises its calls: a wait on the shared one would block every other pair).
        fingerprint: this worker's model fingerprint (workers/kv/wire.py), sent and checked.
        buffers (rank 1): the receiver's pool of reusable host buffers for payloads (None: a fresh
        tensor per transfer)."""
        assert rank in (0, 1)
        self.key = key
        self.buffers = buffers
        self.rank = rank
        self.backend = backend
        self.fingerprint = fingerprint
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.lock = threading.Lock()  # one transfer at a time on this pair
        self._announced = 0  # rank 0: transfers announced; rank 1: the next one the loop waits for
        self._closed = threading.Event()
        # The pair's own thread for blocking sends/receives: a shared pool could fill up with
        # transfers waiting on each other (both halves in one process) and deadlock until timeout.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{key.prefill_id}-{key.decode_id}")
        pstore = self.store = PrefixStore(key.prefix, store)
        self._wait_store = PrefixStore(key.prefix, wait_store) if wait_store is not None else pstore
        self.group: Any = None  # a ProcessGroupGloo or ProcessGroupNCCL of the pair (None over shm)
        self.transport: ShmRing | _GroupTransport
        # The handshake's blocking waits go to the wait store too (when there is one): on the shared
        # client a rendezvous still waiting for its peer would hold up every other pair's calls, and
        # close(), until it timed out. NCCL stays on the shared one: it reads the store again when
        # its communicator is first used, which may be while the receive loop waits on its own.
        handshake = self._wait_store
        if backend == "shm":
            self.transport = offer_ring(handshake, timeout_s) if rank == 1 else attach_ring(handshake, timeout_s)
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            self.group = ProcessGroupNCCL(pstore, rank, 2)  # type: ignore[call-arg]  # options has a default
        else:
            self.group = ProcessGroupGloo(handshake, rank, 2, self.timeout)
        if self.group is not None:
            self.transport = _GroupTransport(self.group, self.timeout, key)
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Stop using the pair. On the receiving side this also wakes the receive loop (it waits for
        the next announcement) with an empty announcement, on which it exits. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.rank == 1:
            try:
                self.store.set(f"announce/{self._announced}", "")
            except Exception:  # noqa: BLE001 - the store is gone: the loop fails on its own
                pass
        if isinstance(self.transport, ShmRing):
            self.transport.mark_closed()  # the peer's next wait fails at once
            if self.rank == 0:  # unmapped on the pair's thread, after any send in progress
                self.executor.submit(self.transport.close)  # (rank 1: the receive loop's exit unmaps it)
        self.executor.shutdown(wait=False)

    def announce(self, transfer_id: str) -> None:
        """Rank 0, holding ``lock``: tell the receive loop that the next transfer on the stream is this one."""
        self._announced += 1
        self.store.set(f"announce/{self._announced}", transfer_id)

    def receive_loop(self, layout: KVLayout, deliver, fail) -> None:
        """Rank 1, on ``executor``: for announcement 1, 2, ...: receive that transfer and call
        ``deliver(transfer id, first block, checks, kv, bytes, seconds, hashes)`` (hashes: as
        ``receive`` returns them). On an error call
        ``fail(error)`` and stop (the pair is unusable). Returns when closed."""
        try:
            self._receive_loop(layout, deliver, fail)
        finally:
            if isinstance(self.transport, ShmRing):
                self.transport.close()  # on the loop's own thread: no receive is using the ring

    def _receive_loop(self, layout: KVLayout, deliver, fail) -> None:
        wait = datetime.timedelta(seconds=300)  # idle pairs just wait again (TCPStore logs each timeout)
        while not self._closed.is_set():
            self._announced += 1
            while not self._closed.is_set():
                try:
                    self._wait_store.wait([f"announce/{self._announced}"], wait)
                    break
                except RuntimeError as e:
                    if "timeout" not in str(e).lower():
                        fail(e)
                        return
            if self._closed.is_set() or not self._wait_store.get(f"announce/{self._announced}"):
                return
            start = time.monotonic()
            try:
                with self.lock:
                    tid, first, checks, kv, nbytes, hashes = self.receive(layout)
            except BaseException as e:  # noqa: BLE001 - any failure poisons the pair
                fail(e)
                return
            deliver(tid, first, checks, kv, nbytes, time.monotonic() - start, hashes)
            del kv  # the consumer's alone now: its buffer is reusable once the consumer drops it

    def send(self, layout: KVLayout, transfer_id: str, first_block: int, kv: torch.Tensor) -> int:
        """Rank 0: send one transfer (caller holds ``lock``). kv [L, 2, n, bs, G, D]. Returns bytes sent.
        Over shm each block is hashed while it is copied into the ring (``ShmRing.send_blocks``);
        over gloo/NCCL the whole payload is hashed on the host. The same checksums either way."""
        n = kv.shape[2]
        assert kv.shape[4] == layout.num_kv_heads, "a transfer carries every kv head (the runner gathers them)"
        payload = kv.contiguous().to(self.device) if self.device.type == "cuda" else _staged(kv)
        head = encode_header(layout, self.fingerprint, transfer_id, first_block, n)
        self.announce(transfer_id)
        self.transport.send(head.to(self.device), _TAG_HEADER)
        if isinstance(self.transport, ShmRing):
            checks = checks_of(payload, first_block, self.transport.send_blocks(payload, _TAG_PAYLOAD))
        else:  # hash the payload while the group sends it (both only read it)
            work = self.transport.start_send(payload, _TAG_PAYLOAD)
            checks = checks_of(payload, first_block)  # [n, 2] of what is sent (the same bits), on the host
            self.transport.finish(work)
        self.transport.send(checks.to(self.device), _TAG_CHECKS)
        return head.nbytes + checks.nbytes + payload.nbytes

    def receive(self, layout: KVLayout) -> tuple[str, int, torch.Tensor, torch.Tensor, int, list[int] | None]:
        """Rank 1: receive one whole transfer (caller holds ``lock``). -> (transfer id, first block,
        checks [n, 2], kv [L, 2, n, bs, G, D], bytes, hashes): hashes are the block checksums of the
        payload as it arrived when the transport computed them on the way (shm), else None."""
        head = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        self.transport.recv(head, _TAG_HEADER)
        tid, first_block, n = decode_header(head.cpu(), layout, self.fingerprint)
        shape = (layout.num_layers, 2, n, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if self.device.type == "cuda":
            kv = torch.empty(shape, dtype=layout.dtype, device=self.device)
        elif torch.cuda.is_available():  # a host transport on a CUDA machine: pinned, one DMA into the cache
            kv = torch.empty(shape, dtype=layout.dtype, pin_memory=True)
        elif self.buffers is not None:
            kv = self.buffers.take(shape, layout.dtype)
        else:
            kv = torch.empty(shape, dtype=layout.dtype)
        hashes = None
        if isinstance(self.transport, ShmRing):
            hashes = self.transport.recv_blocks(kv, _TAG_PAYLOAD)
        else:
            self.transport.recv(kv, _TAG_PAYLOAD)
        checks = torch.empty(n, 2, dtype=torch.int64, device=self.device)
        self.transport.recv(checks, _TAG_CHECKS)
        return tid, first_block, checks.cpu(), kv, head.nbytes + checks.nbytes + kv.nbytes, hashes
