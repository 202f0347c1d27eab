"""AdapterRegistry: the LoRA adapters a router lets requests name, each on its base model.

Three origins, one name space (an adapter's name is unique in the deployment and is no model's name):

    config      ``adapters`` of a model in the config (RouterConfig.adapters / ModelSpec.adapters)
    directory   the model's watched ``adapter_dir``: every subdirectory holding an
                ``adapter_config.json`` is an adapter named after the subdirectory, its source that
                directory. Rescanned when a lookup misses (at most every ``miss_rescan_s``) and on
                listing (at most every ``rescan_s``), so an adapter copied there is servable without
                a call; one removed from there stops being listed and routed. Each router scans on
                its own: routers that see the same directory agree without talking to each other.
    runtime     registered through the admin API (router/adapter_admin.py: HTTP
                ``/v1/load_lora_adapter``, gRPC duet.control.v1.RouterAdmin/LoadAdapter) until
                unloaded. With a controller, shared with every router through it
                (router/shared_adapters.py: ``replace_runtime`` applies the deployment's list);
                a router without one (members set directly) holds its own only.

The router never reads an adapter's files: it hands ``AdapterSpec(name, source)`` to the worker
with each request (SubmitRequest.adapter) and the worker loads it on first use.

Example::

    reg = AdapterRegistry([ModelSpec("SmolLM2-135M-Instruct", "/ckpt", adapters=(AdapterSpec("sql", "/a/sql"),))])
    reg.get("sql").base                         # 'SmolLM2-135M-Instruct'
    reg.register(AdapterSpec("chat", "/a/chat"), "SmolLM2-135M-Instruct")   # origin 'runtime'
    reg.unregister("chat")
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.config import AdapterSpec, ModelSpec, RouterConfigError

logger = logging.getLogger(__name__)

CONFIG, DIRECTORY, RUNTIME = "config", "directory", "runtime"
ADAPTER_CONFIG = "adapter_config.json"  # what makes a subdirectory of adapter_dir an adapter (PEFT)


class AdapterError(Exception):
    """A refused admin call or lookup: ``code`` is the gRPC status (the HTTP API maps it)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RegisteredAdapter:
    """An adapter requests may name: its spec, the served model it runs on, where it came from."""

    spec: AdapterSpec
    base: str
    origin: str

    @property
    def name(self) -> str:
        return self.spec.name


class AdapterRegistry:
    """Single event loop (the router's), like the rest of the router's state."""

    def __init__(self, models: Sequence[ModelSpec], *, rescan_s: float = 5.0, miss_rescan_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._models = {m.name: m for m in models}
        self._fixed: dict[str, RegisteredAdapter] = {}
        for m in models:
            for a in m.adapters:
                self._fixed[a.name] = RegisteredAdapter(a, m.name, CONFIG)
        self._runtime: dict[str, RegisteredAdapter] = {}
        self._scanned: dict[str, RegisteredAdapter] = {}
        self._dirs = {m.name: Path(m.adapter_dir).expanduser() for m in models if m.adapter_dir}
        self._rescan_s = rescan_s
        self._miss_rescan_s = miss_rescan_s
        self._clock = clock
        self._last_scan = float("-inf")
        self._skipped: set[str] = set()  # directory entries already warned about
        self.num_scans = 0

    # ------------------------------------------------------------- lookups
    def get(self, name: str) -> RegisteredAdapter | None:
        """The adapter registered as ``name`` (rescanning the watched directories on a miss)."""
        found = self._lookup(name)
        if found is None and self._dirs and self._clock() - self._last_scan >= self._miss_rescan_s:
            self.rescan()
            found = self._lookup(name)
        return found

    def adapters(self, base: str | None = None) -> list[RegisteredAdapter]:
        """Every registered adapter (of ``base`` only, when given), by base then name."""
        if self._dirs and self._clock() - self._last_scan >= self._rescan_s:
            self.rescan()
        every = {**self._scanned, **self._runtime, **self._fixed}
        return sorted((a for a in every.values() if base is None or a.base == base), key=lambda a: (a.base, a.name))

    def _lookup(self, name: str) -> RegisteredAdapter | None:
        return self._fixed.get(name) or self._runtime.get(name) or self._scanned.get(name)

    # ------------------------------------------------------------- runtime registration
    def register(self, spec: AdapterSpec, base: str) -> RegisteredAdapter:
        """Register ``spec`` on served model ``base`` (the admin API's LoadAdapter)."""
        if base not in self._models:
            raise AdapterError(grpc.StatusCode.NOT_FOUND, f"base_model: unknown model {base!r}; served: "
                               f"{', '.join(self._models)}")
        if spec.name in self._models:
            raise AdapterError(grpc.StatusCode.ALREADY_EXISTS, f"name: {spec.name!r} is a served model's name")
        taken = self._lookup(spec.name)
        if taken is not None:
            raise AdapterError(grpc.StatusCode.ALREADY_EXISTS, f"name: adapter {spec.name!r} is already registered "
                               f"on {taken.base} (from {taken.origin}, source {taken.spec.source}); unload it first")
        adapter = self._runtime[spec.name] = RegisteredAdapter(spec, base, RUNTIME)
        logger.info("adapter %s registered on %s (source %s%s)", spec.name, base, spec.source,
                    ", pinned" if spec.pinned else "")
        return adapter

    def replace_runtime(self, entries: Sequence[tuple[AdapterSpec, str]]) -> None:
        """Make the runtime adapters exactly ``entries`` ((spec, base) pairs: the deployment's shared
        list, router/shared_adapters.py). One whose base this router does not serve, or whose name
        a model or a config adapter has, is skipped with a warning (once)."""
        runtime: dict[str, RegisteredAdapter] = {}
        for spec, base in entries:
            clash = ("its base model is not served here" if base not in self._models else
                     "a served model's name" if spec.name in self._models else
                     f"a config adapter on {self._fixed[spec.name].base}" if spec.name in self._fixed else None)
            if clash is not None:
                self._warn_once(f"shared:{spec.name}:{base}", "shared adapter %s on %s skipped: %s", spec.name, base,
                                clash)
                continue
            runtime[spec.name] = self._runtime.get(spec.name) or RegisteredAdapter(spec, base, RUNTIME)
            if runtime[spec.name].spec != spec or runtime[spec.name].base != base:
                runtime[spec.name] = RegisteredAdapter(spec, base, RUNTIME)
        added, gone = sorted(set(runtime) - set(self._runtime)), sorted(set(self._runtime) - set(runtime))
        if added or gone:
            logger.info("shared adapters: %d (added: %s; removed: %s)", len(runtime), ", ".join(added) or "-",
                        ", ".join(gone) or "-")
        self._runtime = runtime

    def unregister(self, name: str) -> RegisteredAdapter:
        """Forget a runtime adapter; config and directory ones cannot be (FAILED_PRECONDITION)."""
        adapter = self.get(name)
        if adapter is None:
            raise AdapterError(grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter named {name!r} is registered")
        if adapter.origin != RUNTIME:
            where = ("the config" if adapter.origin == CONFIG
                     else f"the watched directory {self._dirs.get(adapter.base)} (remove it there)")
            raise AdapterError(grpc.StatusCode.FAILED_PRECONDITION, f"lora_name: adapter {name!r} comes from {where}; "
                               "only adapters loaded through this API can be unloaded through it")
        del self._runtime[name]
        logger.info("adapter %s unregistered from %s", name, adapter.base)
        return adapter

    # ------------------------------------------------------------- the watched directories
    def rescan(self) -> None:
        """Re-read every model's ``adapter_dir`` (subdirectories holding adapter_config.json)."""
        self._last_scan = self._clock()
        self.num_scans += 1
        found: dict[str, RegisteredAdapter] = {}
        for base, root in self._dirs.items():
            try:
                entries = sorted(os.scandir(root), key=lambda e: e.name)
            except OSError as e:
                self._warn_once(f"dir:{root}", "adapter_dir %s of %s cannot be read (%s); no adapters from it",
                                root, base, e.strerror or e)
                continue
            for entry in entries:
                if not entry.is_dir() or not (Path(entry.path) / ADAPTER_CONFIG).is_file():
                    continue
                name = entry.name
                clash = (f"model {name}" if name in self._models else
                         f"adapter {name} from {o.origin}" if (o := self._fixed.get(name) or self._runtime.get(name)
                                                               or found.get(name)) else None)
                if clash is not None:
                    self._warn_once(f"clash:{entry.path}", "adapter_dir entry %s skipped: the name is taken by %s",
                                    entry.path, clash)
                    continue
                try:
                    spec = AdapterSpec(name, str(Path(entry.path).resolve()))
                except RouterConfigError as e:
                    self._warn_once(f"name:{entry.path}", "adapter_dir entry %s skipped: %s", entry.path, e)
                    continue
                found[name] = RegisteredAdapter(spec, base, DIRECTORY)
        added, gone = sorted(set(found) - set(self._scanned)), sorted(set(self._scanned) - set(found))
        if added or gone:
            logger.info("adapter directories: %d adapters (added: %s; removed: %s)", len(found),
                        ", ".join(added) or "-", ", ".join(gone) or "-")
        self._scanned = found

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._skipped:
            self._skipped.add(key)
            logger.warning(msg, *args)
