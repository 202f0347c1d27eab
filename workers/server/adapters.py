"""The worker's LoRA admin surface: LoadAdapter / UnloadAdapter / ListAdapters, loading a request's
adapter on first use, and the gRPC status of each LoRA error (protos/duet/worker/v1/worker.proto).

Loading reads files and copies tensors (milliseconds to a second): it runs on a worker thread
(``asyncio.to_thread``), never on the engine thread, so the engine keeps stepping the other
requests while a request waits for its adapter.

    error (workers/lora/errors.py)   status
    AdapterError                      INVALID_ARGUMENT     (names the adapter and the module)
    AdapterCapacityError              RESOURCE_EXHAUSTED
    AdapterNotLoaded                  NOT_FOUND
    AdapterInUse                      FAILED_PRECONDITION
    LoraDisabled                      FAILED_PRECONDITION
"""

from __future__ import annotations

import asyncio

import grpc

from protos.duet.worker.v1 import worker_pb2
from workers.lora.adapter_set import AdapterInfo, AdapterSet
from workers.lora.errors import AdapterCapacityError, AdapterError, AdapterInUse, AdapterNotLoaded, LoraDisabled

LORA_ERRORS = (AdapterError, AdapterCapacityError, AdapterNotLoaded, AdapterInUse, LoraDisabled)

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (AdapterError, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AdapterNotLoaded, grpc.StatusCode.NOT_FOUND),
    (AdapterInUse, grpc.StatusCode.FAILED_PRECONDITION),
    (LoraDisabled, grpc.StatusCode.FAILED_PRECONDITION),
)


def lora_status(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status of a LoRA error (None for any other error)."""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code, str(error)
    return None


def info_to_proto(info: AdapterInfo) -> worker_pb2.AdapterInfo:
    return worker_pb2.AdapterInfo(name=info.name, source=info.source, rank=info.rank,
                                  target_modules=list(info.target_modules), pinned=info.pinned, in_use=info.in_use,
                                  load_seconds=info.load_seconds, bytes=info.bytes)


class AdapterAdmin:
    """The adapter set behind the service (None when the engine runs without LoRA)."""

    def __init__(self, adapters: AdapterSet | None) -> None:
        self.adapters = adapters

    def _set(self, name: str) -> AdapterSet:
        if self.adapters is None:
            raise LoraDisabled(f"adapter {name!r}: this worker runs without LoRA (lora.enabled is false)")
        return self.adapters

    async def ensure(self, ref: worker_pb2.AdapterRef) -> str:
        """A request's adapter, loaded (from ref.source) if this worker lacks it; its name."""
        adapters = self._set(ref.name)
        if not ref.name:
            raise AdapterError("adapter.name: empty; name the adapter (or leave adapter unset for the base model)")
        if ref.name in adapters:
            return ref.name
        if not ref.source:
            raise AdapterError(f"adapter {ref.name!r} is not loaded on this worker and the request names no source")
        await asyncio.to_thread(adapters.load, ref.name, ref.source)
        return ref.name

    async def load(self, request: worker_pb2.LoadAdapterRequest) -> worker_pb2.AdapterInfo:
        adapters = self._set(request.adapter.name)
        if not request.adapter.name:
            raise AdapterError("adapter.name: empty; name the adapter")
        info = await asyncio.to_thread(adapters.load, request.adapter.name, request.adapter.source, request.pin)
        return info_to_proto(info)

    def unload(self, request: worker_pb2.UnloadAdapterRequest) -> worker_pb2.UnloadAdapterResponse:
        self._set(request.name).unload(request.name)
        return worker_pb2.UnloadAdapterResponse()

    def list(self) -> worker_pb2.AdapterList:
        if self.adapters is None:
            return worker_pb2.AdapterList()
        return worker_pb2.AdapterList(adapters=[info_to_proto(i) for i in self.adapters.list()],
                                      max_loaded=self.adapters.max_loaded)

    def load_fields(self) -> dict[str, object]:
        """LoadReport's adapters (names loaded now) and max_loaded_adapters."""
        if self.adapters is None:
            return {}
        return dict(adapters=self.adapters.names(), max_loaded_adapters=self.adapters.max_loaded)
