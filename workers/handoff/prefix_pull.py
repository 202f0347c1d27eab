"""Prefix pull: a worker about to compute a prompt whose long prefix another worker holds in its
prefix cache pulls those KV blocks from that worker instead of recomputing them.

Terms:
    puller   the worker that received the request (a Submit with ``prefix_source``, set by the
             router from its prefix tree: router/policies/prefix_pull.py).
    holder   the worker named in ``prefix_source``; it serves the PullPrefix RPC.
    prefix   the first ``prefix_source.num_tokens`` prompt tokens: whole KV blocks, fewer than the
             prompt (the last prompt token is always computed here: its logits give token 1).

Sequence (P = puller, H = holder; both halves of every KV move are workers/kv/transfer.py's)::

    P  engine thread   look the prefix up in its own prefix cache (c blocks held) and allocate
                       blocks c..k-1 under a pull id (``reserve``); nothing to do when c = k
    P  receiver        expect transfer <pull id>, start the pair's channel (shm on one host)
    P -> H  PullPrefix(prefix tokens, first_block=c, P's store, pair key)        [gRPC]
    H  engine thread   look the prefix up in its cache; copy blocks c..k-1 out (``export``):
                       between two steps, so nothing evicts or overwrites them meanwhile; blocks
                       its device cache evicted come from its lower KV tiers (host memory, disk:
                       each verified, checksum and model fingerprint, as it is read; disk reads
                       run on the disk tier's thread, awaited up to cache.tier_load_timeout_s)
    H => P  header (layout + model fingerprint), per-block checksums, payload   [shm / gloo / nccl]
    H -> P  PullPrefixResponse (blocks, bytes)
    P  engine thread   write the blocks, key them in its prefix cache (``install``) and let them
                       go (ref count 0, most recently used); the request is queued right after
                       and its admission takes them as prefix-cache hits: only the rest is computed
Any failure (H unreachable or restarted, H evicted the prefix meanwhile, a refused or corrupted
transfer, no free blocks on P, a timeout) releases P's reserved blocks and the request computes its
whole prompt: the same tokens, only slower. Failures are logged, counted (``prefix_pull_failures``)
and never reach the client. Under heavy memory pressure an installed block may be evicted before
the request is admitted: then it is recomputed, which is also correct.

Worked example (what the Submit handler does)::

    await pull.pull("r1", prompt_ids, submit_request.prefix_source)   # never raises
    engine.add("r1", prompt_ids, params, sink)                          # prefix-cache hits here
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from protos.duet.worker.v1 import worker_pb2
from workers.handoff.disagg import Disaggregation, PrefillRejected
from workers.engine.engine import Engine
from workers.engine.loop import EngineLoop, WorkerUnavailableError
from workers.engine.kv_handoff import KVCapacityError
from workers.kv.tiers.block_file import BlockRefused
from workers.kv.transfer import KVTransferError
from workers.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class PrefixMissing(Exception):
    """The holder no longer holds every block of the prefix (evicted since the router looked)."""


@dataclass
class _Pending:
    """A prefix export whose blocks come partly from the lower tiers: the device's part (a copy,
    [L, 2, n, bs, G, D], or None), then per block its kv from host or a Future of its disk read."""

    on_device: torch.Tensor | None
    parts: list[torch.Tensor | concurrent.futures.Future]
    timeout_s: float

    @property
    def waiting(self) -> bool:
        return any(isinstance(p, concurrent.futures.Future) for p in self.parts)

    async def gather(self) -> torch.Tensor:
        """Await the disk reads (raises BlockRefused for a refused block) and assemble."""
        for i, p in enumerate(self.parts):
            if isinstance(p, concurrent.futures.Future):
                self.parts[i] = (await asyncio.wrap_future(p)).kv
        return self.assemble()

    def assemble(self) -> torch.Tensor:
        """[L, 2, n, bs, G, D] on the CPU, the device's part first."""
        lower = [p for p in self.parts if isinstance(p, torch.Tensor)]
        assert len(lower) == len(self.parts), "disk reads still pending"
        return torch.cat(([self.on_device] if self.on_device is not None else []) + lower, dim=2)


@dataclass
class PullStats:
    """Counters since the worker started (exported in LoadReport, see worker.proto)."""

    pulls: int = 0  # puller: prefixes pulled and installed
    blocks: int = 0
    bytes: int = 0
    failures: int = 0  # puller: pulls that fell back to computing the prompt
    served: int = 0  # holder: pulls served
    tier_blocks_served: int = 0  # holder: blocks of those read from its lower KV tiers (host, disk)


class PrefixPull:
    """A worker's puller and holder halves (see the module docstring). Event-loop methods only;
    every engine access runs on the engine thread through ``EngineLoop.call``."""

    def __init__(self, engine: EngineLoop, disagg: Disaggregation, block_size: int, timeout_s: float) -> None:
        self._engine = engine
        self._disagg = disagg
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.stats = PullStats()
        self._reserved: dict[str, Sequence] = {}  # engine thread only: pull id -> its pseudo sequence
        self._ids = itertools.count()

    # ------------------------------------------------------------------ puller
    async def pull(self, request_id: str, prompt: list[int], source: worker_pb2.PrefixSource,
                   adapter: str = "") -> bool:
        """Pull the prefix ``source`` names into this worker's prefix cache. Returns whether blocks
        were installed; never raises (a failure is logged and counted, the prompt is computed).
        adapter: the LoRA adapter the request runs with ("" = the base model): the holder's blocks
        computed under it are pulled and keyed under it here (workers/engine/block_manager.py root_key)."""
        pull_id = f"pull/{request_id}/{next(self._ids)}"
        installed = False
        try:
            tokens = self._prefix_tokens(prompt, source)
            installed = await asyncio.wait_for(self._pull(pull_id, tokens, source, adapter), self.timeout_s)
        except (KVTransferError, KVCapacityError, PrefixMissing, PrefillRejected, WorkerUnavailableError,
                grpc.aio.AioRpcError, TimeoutError, ValueError) as e:
            self.stats.failures += 1
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else (str(e) or "timed out")
            logger.warning("request %s: prefix pull from %s failed (%s); computing the prompt instead (failure #%d)",
                           request_id, source.worker_id, why, self.stats.failures)
        finally:
            if not installed:
                self._engine.call(lambda engine: self._release(engine, pull_id))
        return installed

    def _prefix_tokens(self, prompt: list[int], source: worker_pb2.PrefixSource) -> list[int]:
        n, bs = source.num_tokens, self.block_size
        if n < bs or n % bs or n >= len(prompt):
            raise ValueError(f"prefix_source.num_tokens={n}: must be a positive multiple of the KV block size "
                             f"{bs} below the prompt's {len(prompt)} tokens")
        if not source.endpoint or not source.worker_id:
            raise ValueError("prefix_source.worker_id and .endpoint: both required")
        return prompt[:n]

    async def _pull(self, pull_id: str, tokens: list[int], source: worker_pb2.PrefixSource, adapter: str) -> bool:
        reserved = await self._engine.call(lambda engine: self._reserve(engine, pull_id, tokens, adapter))
        if isinstance(reserved, Exception):
            raise reserved
        if reserved is None:
            logger.debug("%s: every prefix block is cached here already; nothing to pull", pull_id)
            return False
        first, count = reserved
        disagg, receiver = self._disagg, self._disagg.receiver
        backend = disagg.backend_for(source.endpoint)
        key = receiver.pair_key(source.worker_id, source.incarnation, backend)
        expected = receiver.expect(key, pull_id, first, count)
        receiver.channel(key)
        try:
            request = worker_pb2.PullPrefixRequest(
                transfer_id=pull_id, prefix_token_ids=tokens, first_block=first,
                kv_store_address=receiver.address, receiver_worker_id=disagg.worker_id,
                receiver_incarnation=disagg.incarnation, pair_generation=key.generation,
                expected_incarnation=source.incarnation, backend=backend)
            if adapter:
                request.adapter.name = adapter
            await disagg.stub(source.endpoint).PullPrefix(request, timeout=self.timeout_s)
            received = await asyncio.wrap_future(expected)
        finally:
            receiver.cancel(pull_id)
        done = await self._engine.call(lambda engine: self._install(engine, pull_id, received.kv))
        if isinstance(done, Exception):
            raise WorkerUnavailableError(f"installing the pulled blocks failed: {done!r}")
        s = self.stats
        s.pulls, s.blocks, s.bytes = s.pulls + 1, s.blocks + count, s.bytes + received.num_bytes
        logger.info("%s: pulled %d prefix blocks (%d held here) from %s over %s, %.2f MB in %.1f ms", pull_id,
                    count, first, source.worker_id, backend, received.num_bytes / 1e6, received.seconds * 1e3)
        return True

    # engine thread ---------------------------------------------------------------
    def _reserve(self, engine: Engine, pull_id: str, tokens: list[int], adapter: str = "") -> tuple[int, int] | None:
        """(first block to pull, blocks to pull) with those blocks allocated; None if all are cached here."""
        bm = engine.block_manager
        assert bm.block_size == self.block_size
        cached = bm.cached_prefix(tokens, adapter)
        total = len(tokens) // bm.block_size
        if len(cached) >= total:
            return None
        seq = Sequence(pull_id, list(tokens), SamplingParams(), -1, adapter=adapter)
        seq.num_computed_tokens = len(cached) * bm.block_size
        if not bm.allocate(seq, len(tokens) - seq.num_computed_tokens, cached):
            raise KVCapacityError(f"{total - len(cached)} KV blocks needed for the pulled prefix, "
                                  f"{bm.num_free_blocks} free")
        self._reserved[pull_id] = seq
        return len(cached), total - len(cached)

    def _install(self, engine: Engine, pull_id: str, kv: torch.Tensor) -> int:
        """Write the pulled blocks (kv [L, 2, n, bs, G, D], verified), key them, let them go."""
        seq = self._reserved.pop(pull_id)
        bm = engine.block_manager
        table = bm.block_table(pull_id)
        first = seq.num_computed_tokens // bm.block_size
        try:
            engine.runner.write_blocks(table[first : first + kv.shape[2]], kv)
            seq.num_computed_tokens = seq.num_tokens
            bm.cache_computed_blocks(seq)
        finally:
            bm.free(pull_id)  # cached and free: the request's admission takes them
        return kv.shape[2]

    def _release(self, engine: Engine, pull_id: str) -> None:
        if self._reserved.pop(pull_id, None) is not None:
            engine.block_manager.free(pull_id)

    # ------------------------------------------------------------------ holder
    async def serve(self, request: worker_pb2.PullPrefixRequest) -> worker_pb2.PullPrefixResponse:
        """One PullPrefix call. Raises PrefillRejected (status code + message) or WorkerUnavailableError."""
        disagg, bs = self._disagg, self.block_size
        if request.expected_incarnation and request.expected_incarnation != disagg.incarnation:
            raise PrefillRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"expected_incarnation: this worker is {disagg.incarnation} (it restarted)")
        tokens = list(request.prefix_token_ids)
        if not request.transfer_id or not request.kv_store_address or not request.receiver_worker_id:
            raise PrefillRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                  "transfer_id, kv_store_address and receiver_worker_id: all required")
        if not tokens or len(tokens) % bs or request.first_block >= len(tokens) // bs:
            raise PrefillRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"prefix_token_ids / first_block: {len(tokens)} tokens (a positive multiple of "
                                  f"the block size {bs}) with first_block {request.first_block} below their blocks")
        sender = disagg.sender_for(request.backend)
        key = disagg.sender_key(request.receiver_worker_id, request.receiver_incarnation, request.pair_generation,
                                request.backend)
        channel_future = sender.channel(key, request.kv_store_address)
        adapter = request.adapter.name if request.HasField("adapter") else ""
        kv = await self._read(tokens, request.first_block, adapter)
        if isinstance(kv, PrefixMissing):
            raise PrefillRejected(grpc.StatusCode.FAILED_PRECONDITION, f"prefix_token_ids: {kv}")
        if isinstance(kv, Exception):
            raise WorkerUnavailableError(f"reading the prefix blocks failed: {kv!r}")
        start = time.monotonic()
        try:
            channel = await asyncio.wait_for(asyncio.wrap_future(channel_future), self.timeout_s)
            nbytes = await asyncio.get_running_loop().run_in_executor(
                channel.executor, sender.send, channel, request.transfer_id, request.first_block, kv)
        except (KVTransferError, TimeoutError) as e:
            raise WorkerUnavailableError(f"prefix transfer to {request.receiver_worker_id} failed: "
                                         f"{e or 'timed out'}") from None
        self.stats.served += 1
        return worker_pb2.PullPrefixResponse(num_blocks=kv.shape[2], kv_bytes=nbytes,
                                             transfer_seconds=time.monotonic() - start)

    async def _read(self, tokens: list[int], first_block: int, adapter: str) -> torch.Tensor | Exception:
        """The holder's blocks first_block.. of the prefix (``_export``), waiting off the engine thread
        for those read from its disk tier, at most the tiers' ``tier_load_timeout_s``."""
        kv = await self._engine.call(lambda engine: self._export(engine, tokens, first_block, adapter, self.stats))
        if not isinstance(kv, _Pending):
            return kv
        try:
            return await asyncio.wait_for(kv.gather(), kv.timeout_s)
        except TimeoutError:
            for part in kv.parts:
                if isinstance(part, concurrent.futures.Future):
                    part.cancel()
            return PrefixMissing(f"the prefix's blocks on this worker's disk tier were not read within "
                                 f"{kv.timeout_s}s (cache.tier_load_timeout_s)")
        except BlockRefused as e:  # never sent; a lookup here later refuses, counts and drops it too
            return PrefixMissing(f"a prefix block on this worker's disk tier was refused ({e.kind}): {e}")

    @staticmethod
    def _export(engine: Engine, tokens: list[int], first_block: int, adapter: str = "",
                stats: PullStats | None = None) -> torch.Tensor | PrefixMissing | _Pending:
        """Engine thread: a copy of the prefix's blocks first_block.. ([L, 2, n, bs, G, D]) computed
        under ``adapter``, or PrefixMissing (returned, not raised: a normal outcome, not an engine
        failure). Blocks past the device's prefix-cache hits come from the lower tiers (host
        memory, disk: workers/engine/kv_tiers.py ``read_prefix``), each verified against its
        checksum and the model fingerprint as it is read; with some on disk the result is
        _Pending: their reads run on the disk thread (the engine thread never waits on disk).
        stats: where to count the blocks read from the lower tiers."""
        blocks = engine.block_manager.cached_prefix(tokens, adapter)
        total = len(tokens) // engine.block_manager.block_size
        if len(blocks) >= total:
            return engine.runner.read_blocks(blocks[first_block:])
        tiers = engine.tiers
        missing = PrefixMissing(f"this worker holds {len(blocks)} of the prefix's {total} blocks (evicted since"
                                f"{', and not the rest in its lower KV tiers' if tiers is not None else ''})")
        if tiers is None:
            return missing
        start = max(first_block, len(blocks))
        below = tiers.read_prefix(tokens, adapter, start, total - start)
        if below is None:
            return missing
        if stats is not None:
            stats.tier_blocks_served += len(below)
        on_device = engine.runner.read_blocks(blocks[first_block:]).cpu() if start > first_block else None
        pending = _Pending(on_device, below, tiers.load_timeout_s)
        return pending if pending.waiting else pending.assemble()

    # ------------------------------------------------------------------ stats
    def load_fields(self) -> dict[str, int]:
        s = self.stats
        return dict(prefix_pulls=s.pulls, prefix_pull_blocks=s.blocks, prefix_pull_bytes=s.bytes,
                    prefix_pull_failures=s.failures, prefix_pulls_served=s.served,
                    prefix_pull_tier_blocks_served=s.tier_blocks_served)
