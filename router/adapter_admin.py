"""The adapter admin API's logic, shared by both front doors: gRPC duet.control.v1.RouterAdmin
(LoadAdapter, UnloadAdapter, ListAdapters; router/admin.py) and HTTP ``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter``, ``GET /v1/lora_adapters`` (router/http_api/app.py). Both need the
``admin`` token scope (router/security.py).

    load     register the adapter on its base model (router/adapters.py: requests may name it from
             now on); with ``preload``, first have the least-loaded healthy worker of that model load
             it (worker RPC LoadAdapter, ``pin`` = pinned): the worker reads and checks the files, so a
             bad path, rank or module is refused here, with the worker's message, and nothing is
             registered. Without preload a worker loads it on its first request.
    unload   unregister it (new requests naming it get NOT_FOUND), then ask every worker of its model
             that serves adapters to unload it (worker RPC UnloadAdapter): NOT_FOUND there (never loaded) is fine;
             FAILED_PRECONDITION (requests still running with it) leaves it to that worker's LRU,
             reported as ``busy``.
    list     every registered adapter, with the workers whose latest load report lists it.
    shared   with ``shared`` (a router following a controller: router/shared_adapters.py), a load
             is shared with every router through the controller once it succeeded here (a refusal
             there -- the name shared with another source, or no controller reachable -- undoes
             it: nothing is registered), and an unload is unshared before the workers drop it.
    pinned   ``keep_pinned`` (every few seconds, RouterServer): each pinned adapter is loaded with
             ``pin`` on every healthy worker of its model that serves adapters (its report's
             max_loaded_adapters > 0) and does not list it; once per worker incarnation, so a
             refusal is logged once, not retried in a loop. A request names no pin: without this,
             a config adapter's ``pinned`` would only hold on the worker a preload chose.

Errors are AdapterError (a gRPC status + message naming the field); the HTTP API maps NOT_FOUND to
404, INVALID_ARGUMENT to 400, as the issue's API asks (vLLM's status codes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from protos.duet.worker.v1 import worker_pb2
from router.adapters import AdapterError, RegisteredAdapter
from router.catalog import ModelCatalog
from router.config import AdapterSpec, RouterConfigError
from router.policies import WorkerState
from router.policies.least_loaded import least_loaded
from router.shared_adapters import SharedAdapters

logger = logging.getLogger(__name__)

# worker status of LoadAdapter -> the admin call's status
_LOAD_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND: grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,  # LoRA off there
                grpc.StatusCode.UNIMPLEMENTED: grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class UnloadResult:
    adapter: RegisteredAdapter
    unloaded_from: tuple[str, ...]
    busy: tuple[str, ...]


class AdapterAdmin:
    """``workers()``: the directory's snapshot; ``stub_of(worker_id)``: its worker stub;
    ``serves(worker, model)``: whether a worker serves a model (router/pipeline.py)."""

    def __init__(self, catalog: ModelCatalog, workers: Callable[[], Sequence[WorkerState]],
                 stub_of: Callable[[str], Any], serves: Callable[[WorkerState, str], bool], *,
                 timeout_s: float = 120.0, shared: SharedAdapters | None = None) -> None:
        self.catalog = catalog
        self.registry = catalog.adapters
        self._workers = workers
        self._stub_of = stub_of
        self._serves = serves
        self.timeout_s = timeout_s
        self.shared = shared  # None: adapters loaded here are this router's only
        self._pin_tried: set[tuple[str, str, str]] = set()  # (worker id, incarnation, adapter)
        self.num_pinned_loads = 0

    def _model_workers(self, base: str, healthy: bool = True) -> list[WorkerState]:
        """The workers of ``base`` (healthy ones only, by default) that serve adapters (their load
        report's max_loaded_adapters > 0)."""
        return [w for w in self._workers() if self._serves(w, base) and (w.healthy or not healthy)
                and w.max_loaded_adapters > 0]

    async def load(self, name: str, source: str, base: str = "", *, preload: bool = True,
                   pinned: bool = False) -> RegisteredAdapter:
        base = base or self.catalog.default.name
        if base not in self.catalog:
            raise AdapterError(grpc.StatusCode.NOT_FOUND, f"base_model: unknown model {base!r}; served: "
                               f"{', '.join(self.catalog.names)}")
        try:
            spec = AdapterSpec(name, source, pinned)
        except RouterConfigError as e:
            field = str(e).split("=", 1)[0]
            raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{'lora_name' if field == 'name' else 'lora_path'}: {e}") from None
        adapter = self.registry.register(spec, base)
        try:
            if preload:
                await self._preload(adapter)
            if self.shared is not None:
                await self.shared.put(adapter)
        except BaseException:
            if self.registry.get(name) == adapter:
                self.registry.unregister(name)
            raise
        return adapter

    async def _preload(self, adapter: RegisteredAdapter) -> None:
        healthy = self._model_workers(adapter.base)
        if not healthy:
            if any(w.healthy and self._serves(w, adapter.base) for w in self._workers()):
                raise AdapterError(grpc.StatusCode.FAILED_PRECONDITION, f"base_model: no worker of {adapter.base} "
                                   f"serves LoRA adapters (their load reports say max_loaded_adapters 0); adapter "
                                   f"{adapter.name} not registered")
            raise AdapterError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker serves {adapter.base} to load "
                               f"adapter {adapter.name} on; retry, or load it with preload off")
        worker = least_loaded(healthy)
        ref = worker_pb2.AdapterRef(name=adapter.name, source=adapter.spec.source)
        try:
            info = await self._stub_of(worker.worker_id).LoadAdapter(
                worker_pb2.LoadAdapterRequest(adapter=ref, pin=adapter.spec.pinned), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            code = _LOAD_ERRORS.get(e.code(), grpc.StatusCode.UNAVAILABLE)
            detail = ("it serves no LoRA adapters (UNIMPLEMENTED)" if e.code() == grpc.StatusCode.UNIMPLEMENTED
                      else f"{e.code().name}: {e.details()}")
            raise AdapterError(code, f"lora_path: worker {worker.worker_id} of {adapter.base} refused adapter "
                               f"{adapter.name} ({adapter.spec.source}): {detail}") from None
        logger.info("adapter %s loaded on %s (rank %d, %s, %.2f s)", adapter.name, worker.worker_id, info.rank,
                    ", ".join(info.target_modules) or "?", info.load_seconds)

    async def unload(self, name: str) -> UnloadResult:
        base, sep, short = name.partition(":")
        if sep and base in self.catalog:
            found = self.registry.get(short)
            if found is None or found.base != base:
                raise AdapterError(grpc.StatusCode.NOT_FOUND, f"lora_name: {base} has no adapter {short!r}")
            name = short
        adapter = self.registry.unregister(name)
        if self.shared is not None:
            try:
                await self.shared.delete(adapter.name)
            except BaseException:
                if self.registry.get(adapter.name) is None:  # still shared: it stays routable here too
                    self.registry.register(adapter.spec, adapter.base)
                raise
        done, busy = [], []
        for w in self._model_workers(adapter.base, healthy=False):
            try:
                await self._stub_of(w.worker_id).UnloadAdapter(worker_pb2.UnloadAdapterRequest(name=adapter.name),
                                                               timeout=self.timeout_s)
                done.append(w.worker_id)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    busy.append(w.worker_id)
                elif e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                    logger.warning("adapter %s: unloading it from %s failed (%s: %s); its LRU evicts it", adapter.name,
                                   w.worker_id, e.code().name, e.details())
        logger.info("adapter %s unloaded (from %s; still busy on %s)", adapter.name, ", ".join(done) or "-",
                    ", ".join(busy) or "-")
        return UnloadResult(adapter, tuple(done), tuple(busy))

    async def keep_pinned(self) -> None:
        """Load every pinned adapter, pinned, where it is missing (the module docstring's ``pinned``)."""
        for adapter in self.registry.adapters():
            if not adapter.spec.pinned:
                continue
            for w in self._model_workers(adapter.base):
                key = (w.worker_id, w.incarnation, adapter.name)
                if adapter.name in w.adapters or key in self._pin_tried:
                    continue
                self._pin_tried.add(key)
                ref = worker_pb2.AdapterRef(name=adapter.name, source=adapter.spec.source)
                try:
                    await self._stub_of(w.worker_id).LoadAdapter(worker_pb2.LoadAdapterRequest(adapter=ref, pin=True),
                                                                 timeout=self.timeout_s)
                    self.num_pinned_loads += 1
                    logger.info("pinned adapter %s loaded on %s", adapter.name, w.worker_id)
                except grpc.aio.AioRpcError as e:
                    logger.warning("pinned adapter %s: %s refused to load it (%s: %s); not retried until it restarts",
                                   adapter.name, w.worker_id, e.code().name, e.details())

    def list(self) -> list[tuple[RegisteredAdapter, list[str]]]:
        """Every registered adapter and the workers whose latest report lists it loaded."""
        workers = self._workers()
        return [(a, sorted(w.worker_id for w in workers if a.name in w.adapters and self._serves(w, a.base)))
                for a in self.registry.adapters()]
