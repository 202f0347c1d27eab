"""Both halves of a disaggregated request, on the worker's event loop (the gRPC side of a worker).

Sequence for one request (D = decode worker, P = prefill worker; the router sent D a Submit with
``remote_prefill`` = P)::

    D  engine.reserve          prefix-cache hits + blocks for the rest -> KVTicket
    D  receiver.expect(tid)    register the transfer this request waits for
    D  receiver.channel(pair)  start (or reuse) the pair's channel rendezvous on D's store (shm when P
                               is on D's host and the cache on the CPU, else gloo/nccl: ``choose_backend``);
                               once up, the pair's receive loop reads every announced transfer
    D -> P  Prefill(ticket, D's store address, pair key)          [gRPC, worker to worker]
    P  sender.channel(pair)    join the same rendezvous (first time for this pair key only)
    P  engine: compute the prompt (chunked, prefix cache), sample token 1, copy out blocks
       first_block.. and free everything (KVExport)
    P -> D  PrefillResponse #1 (token 1, its logprobs if asked, generator state)
    P => D  announce, header, per-block (seq, checksum), payload   [shm ring / gloo / nccl, never gRPC]
    D  receive loop            read + verify (layout, id, range, sequence numbers, checksums) and
                               settle the request's future
    P -> D  PrefillResponse #2 (bytes, seconds)                 "sent"
    D  engine.import_kv        write the blocks, restore the generator, append token 1, decode on

Failure anywhere before import (P unreachable, P restarted, P's engine full or failing, the
transfer timing out, a dead peer, a rejected check) raises ``RemotePrefillError``; the Submit
handler ends the call with ABORTED and its ``finally`` aborts the reservation, so every reserved
block returns. The router retries ABORTED once, colocated on a decode worker. On P, a cancelled
Prefill call (D died or gave up) aborts the request in P's engine; a send to a dead D fails and
drops the pair. P holds no blocks while it sends: the export is a copy.
"""

from __future__ import annotations

import asyncio
from typing import Any
import logging
import time
from collections.abc import AsyncIterator

import grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.engine.loop import EngineLoop, Sink, WorkerUnavailableError
from workers.kv.transfer import KVReceiver, KVSender, KVTransferError, PairKey, choose_backend, resolve_kv_backend
from workers.engine.runner import KVLayout, KVTicket
from workers.sample.logprobs_proto import from_proto, to_proto
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 2000)]


class RemotePrefillError(Exception):
    """The prefill half failed (worker, transfer or verification); no token was produced."""


class PrefillRejected(Exception):
    """A Prefill request this worker will not serve; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Disaggregation:
    """A worker's KV sender (prefill half) and receiver (decode half) plus the Prefill client.

    timeout_s bounds every wait on a peer: rendezvous, each transfer message, the Prefill call's
    second message. host: the address the decode-side store binds and advertises."""

    def __init__(self, engine: EngineLoop, layout: KVLayout, worker_id: str, incarnation: str, *,
                 host: str = "127.0.0.1", device: str = "cpu", timeout_s: float = 30.0,
                 kv_backend: str = "auto", fingerprint: int = 0) -> None:
        """kv_backend: ``kv_transfer_backend`` of this worker's decode half (workers/kv/transfer.py).
        fingerprint: the model fingerprint (workers/kv/wire.py) every transfer carries and checks."""
        assert layout.holds_all_heads, "a worker's engine holds (or gathers) every kv head"
        self.backend = resolve_kv_backend(kv_backend, device)  # for peers on other hosts
        self.requested_backend = kv_backend
        self.device = device
        self.host = host
        self.fingerprint = fingerprint
        self.on_cuda = device.startswith("cuda")
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self._engine = engine
        self._layout = layout
        self._senders = {self.backend: KVSender(layout, self.backend, timeout_s, fingerprint)}
        self.receiver = KVReceiver(layout, worker_id, incarnation, host, self.backend, timeout_s, fingerprint)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._backends: dict[str, str] = {}  # peer endpoint -> backend (backend_for)

    # ------------------------------------------------------------- decode half
    async def decode(self, request_id: str, prompt: list[int], params: SamplingParams,
                     sampling: worker_pb2.SamplingParams, remote: worker_pb2.RemotePrefill, sink: Sink,
                     resumed_output_tokens: int = 0, adapter: worker_pb2.AdapterRef | None = None) -> None:
        """Reserve, have ``remote`` prefill, receive and verify, import. Outputs then arrive on
        ``sink`` (the first one carries token 1). Raises InvalidRequestError / KVCapacityError
        (from reserve) or RemotePrefillError; the caller aborts the request on any error.
        adapter: the request's LoRA adapter (loaded here already): the prefill worker computes the
        prompt under it (loading it from its source first) and both sides key the KV with it."""
        name = adapter.name if adapter is not None else ""
        ticket = await self._engine.reserve(request_id, prompt, params, resumed_output_tokens, name)
        if isinstance(ticket, Exception):
            raise ticket
        backend = self.backend_for(remote.endpoint)
        key = self.receiver.pair_key(remote.worker_id, remote.incarnation, backend)
        expected = self.receiver.expect(key, ticket.transfer_id, ticket.first_block, ticket.num_blocks)
        self.receiver.channel(key)  # start the rendezvous now; P joins when the request reaches it
        prefill = self._prefill_request(request_id, prompt, sampling, ticket, key, remote.incarnation,
                                        resumed_output_tokens, backend)
        if name:
            assert adapter is not None
            prefill.adapter.CopyFrom(adapter)
        call = self._stub(remote.endpoint).Prefill(prefill)
        try:
            first = await call.read()
            if first is grpc.aio.EOF:
                raise RemotePrefillError(f"prefill worker {remote.worker_id} ended the call without a result")
            received = await asyncio.wait_for(asyncio.wrap_future(expected), self.timeout_s)
            done = await asyncio.wait_for(call.read(), self.timeout_s)
            if done is grpc.aio.EOF or not done.transfer_done:
                raise RemotePrefillError(f"prefill worker {remote.worker_id} did not confirm the transfer")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the request itself (e.g. a grammar that admits
                raise PrefillRejected(e.code(), e.details()) from None  # no first token): no retry helps
            raise RemotePrefillError(f"prefill worker {remote.worker_id}: {e.code().name}: {e.details()}") from None
        except (KVTransferError, TimeoutError) as e:
            raise RemotePrefillError(f"KV transfer from {remote.worker_id} failed: {e or 'timed out'}") from None
        finally:
            self.receiver.cancel(ticket.transfer_id)
            if not call.done():
                call.cancel()
        logger.info("request %s: %d prompt blocks from %s (%d cached here), %.2f MB in %.1f ms", request_id,
                    ticket.num_blocks, remote.worker_id, ticket.first_block, received.num_bytes / 1e6,
                    received.seconds * 1e3)
        first_logprob = from_proto(first.first_token_logprob) if first.HasField("first_token_logprob") else None
        self._engine.import_kv(request_id, ticket, received.kv, first.first_token_id,
                               first.generator_state or None, sink, first_logprob)

    def _prefill_request(self, request_id: str, prompt: list[int], sampling: worker_pb2.SamplingParams,
                         ticket: KVTicket, key: PairKey, incarnation: str,
                         resumed_output_tokens: int, backend: str) -> worker_pb2.PrefillRequest:
        return worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, transfer_id=ticket.transfer_id,
            first_block=ticket.first_block, num_blocks=ticket.num_blocks, kv_store_address=self.receiver.address,
            decode_worker_id=self.worker_id, decode_incarnation=self.incarnation, pair_generation=key.generation,
            expected_incarnation=incarnation, backend=backend, resumed_output_tokens=resumed_output_tokens)

    def backend_for(self, peer_endpoint: str) -> str:
        """The transport for KV this worker receives from the worker at ``peer_endpoint`` (decided
        once per endpoint: a host name is resolved only the first time)."""
        backend = self._backends.get(peer_endpoint)
        if backend is None:
            backend = self._backends[peer_endpoint] = choose_backend(self.requested_backend, self.device,
                                                                     peer_endpoint, self.host)
        return backend

    def sender_for(self, backend: str) -> KVSender:
        """The sender for a receiver's ``backend`` ('gloo', 'shm' or 'nccl'; nccl only from a CUDA
        cache). Raises PrefillRejected (FAILED_PRECONDITION) for one this worker cannot send."""
        if backend not in ("gloo", "nccl", "shm") or (backend == "nccl" and not self.on_cuda):
            raise PrefillRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"backend: the receiver uses {backend!r}, which this worker cannot send "
                                  "(nccl needs its cache on CUDA; gloo and shm work from any device)")
        return self._sender(backend)

    def sender_key(self, receiver_id: str, receiver_incarnation: str, generation: int, backend: str) -> PairKey:
        """The pair key a receiver named (its id, incarnation, generation and backend)."""
        return PairKey(self.worker_id, self.incarnation, receiver_id, receiver_incarnation, generation,
                       "shm" if backend == "shm" else "")

    def stub(self, endpoint: str) -> worker_pb2_grpc.WorkerStub:
        """A Worker stub for a peer (one channel per endpoint, closed with this object)."""
        return self._stub(endpoint)

    def _stub(self, endpoint: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        return worker_pb2_grpc.WorkerStub(channel)

    # ------------------------------------------------------------- prefill half
    async def prefill(self, request: worker_pb2.PrefillRequest,
                      params: SamplingParams) -> AsyncIterator[worker_pb2.PrefillResponse]:
        """Serve one Prefill call (see the module docstring). Raises PrefillRejected."""
        if request.expected_incarnation and request.expected_incarnation != self.incarnation:
            raise PrefillRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"expected_incarnation: this worker is {self.incarnation} (it restarted)")
        sender = self.sender_for(request.backend)
        if not request.transfer_id or request.num_blocks < 1 or not request.kv_store_address:
            raise PrefillRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                  "transfer_id, num_blocks and kv_store_address: all required")
        key = self.sender_key(request.decode_worker_id, request.decode_incarnation, request.pair_generation,
                              request.backend)
        channel_future = sender.channel(key, request.kv_store_address)
        rid, sink = f"prefill/{request.request_id}", asyncio.Queue[Any]()
        self._engine.add(rid, list(request.prompt_token_ids), params, sink, export_from_block=request.first_block,
                         resumed_output_tokens=request.resumed_output_tokens,
                         adapter=request.adapter.name if request.HasField("adapter") else "")
        finished = False
        try:
            out = await sink.get()
            finished = True
            if isinstance(out, Exception):
                raise out
            export = out.kv_export
            if export is None:
                raise WorkerUnavailableError(f"prefill of {request.request_id} ended without a result")
            if export.kv.shape[2] != request.num_blocks:
                raise PrefillRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"num_blocks: {request.num_blocks} reserved, the prompt needs {export.kv.shape[2]}")
            channel = await asyncio.wait_for(asyncio.wrap_future(channel_future), self.timeout_s)
            yield worker_pb2.PrefillResponse(
                first_token_id=export.first_token, generator_state=export.generator_state or b"",
                cached_prompt_tokens=out.num_cached_tokens,
                first_token_logprob=to_proto(export.first_logprob) if export.first_logprob is not None else None)
            start = time.monotonic()
            nbytes = await asyncio.get_running_loop().run_in_executor(
                channel.executor, sender.send, channel, request.transfer_id, export.first_block, export.kv)
            yield worker_pb2.PrefillResponse(transfer_done=True, kv_bytes=nbytes,
                                             transfer_seconds=time.monotonic() - start)
        except (KVTransferError, TimeoutError) as e:
            raise WorkerUnavailableError(f"KV transfer to {request.decode_worker_id} failed: {e or 'timed out'}") \
                from None
        finally:
            if not finished:
                self._engine.abort(rid)  # the decode side gave up (or died): free the prefill state

    # ------------------------------------------------------------- stats, lifecycle
    def load_fields(self) -> dict[str, float | int]:
        """KV-transfer counters for the LoadReport."""
        ss, r = [x.stats for x in self._senders.values()], self.receiver.stats
        return dict(kv_transfers_sent=sum(s.transfers_sent for s in ss), kv_bytes_sent=sum(s.bytes_sent for s in ss),
                    kv_transfers_received=r.transfers_received, kv_bytes_received=r.bytes_received,
                    kv_transfer_failures=sum(s.failures for s in ss) + r.failures,
                    kv_transfer_seconds=sum(s.seconds for s in ss) + r.seconds)

    def _sender(self, backend: str) -> KVSender:
        """The prefill half's sender for the decode side's backend (one per backend, made on first use)."""
        sender = self._senders.get(backend)
        if sender is None:
            sender = self._senders[backend] = KVSender(self._layout, backend, self.timeout_s, self.fingerprint)
        return sender

    @property
    def sender(self) -> KVSender:
        """The sender for this worker's own backend (what a same-device peer asks for)."""
        return self._senders[self.backend]

    async def close(self) -> None:
        self.receiver.close()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
