"""The router's public gRPC server: duet.v1.Duet, grpc.health.v1 and server reflection; and, on
``config.http_port`` (0 = off), the OpenAI-compatible HTTP API (router/http_api/) on the same event
loop, answering from the same Pipeline, auth and metrics.

Two ways to run it:

    # in your own event loop (e.g. the cluster controller's)
    server = await start_router(config, members=[("w0", "10.0.0.5:50061")])
    await server.set_members([...])          # on every pool change: joins and leaves, no restart
    await server.stop()

    # on a background thread with its own loop (CLI, Ray actor, tests); methods are blocking
    handle = serve_router(config, members=[("w0", "10.0.0.5:50061")])
    handle.set_members([...]); handle.stop()

Health: the overall service ("") and "duet.v1.Duet" are SERVING while at least one worker is
healthy, NOT_SERVING otherwise (and from the moment shutdown begins): a readiness check.
"duet.control.v1.RouterAdmin" is SERVING from start until shutdown whatever the workers do: a
liveness check (a router without workers is alive, just not ready; restarting it would not help).

Membership: either set directly (``members=`` and ``set_members``), or, with
``config.membership_address``, followed from the controller's duet.control.v1.Membership stream
(router/membership.py): the router then runs as its own process or Kubernetes Deployment and
learns of joins and leaves without a restart. The router also serves duet.control.v1.RouterAdmin
(its counters, for ``duet status``) on the same port.

Run a standalone router against running workers (debugging, benchmarks)::

    python -m router.server --tokenizer ~/.cache/duet/models/SmolLM2-135M-Instruct \\
        --worker w0=127.0.0.1:50061 --worker w1=127.0.0.1:50062
    python -m router.server --tokenizer ... --membership 10.0.0.2:50052   # follow a controller
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import asyncio
import functools
import contextlib
from contextlib import aclosing
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.adapter_admin import AdapterAdmin
from router.adapters import AdapterRegistry
from router.admin import RouterAdminServicer
from router.catalog import ModelCatalog
from router.admission import AdmissionController
from router.config import RouterConfig, RouterConfigError
from router.hold import WorkerHold
from router.membership import MembershipWatcher, wake_pools
from router.shared_adapters import SharedAdapters
from router.fanout import FanOut
from router.pipeline import Pipeline
from router.policies import make_policy
from router.prefix_index import PrefixIndex
from router.preprocess import RequestError, ServedModel
from router.prometheus import metrics_registry
from router.rebalancer import RebalanceSettings, Rebalancer
from router.request_metrics import RequestMetrics
from router.security import BearerTokenInterceptor, SecurityConfigError, TokenStore, server_credentials
from router.workers import WorkerDirectory

if TYPE_CHECKING:
    from router.http_api.server import HttpApiServer

logger = logging.getLogger(__name__)

DUET_SERVICE = duet_pb2.DESCRIPTOR.services_by_name["Duet"].full_name  # "duet.v1.Duet"
ADMIN_SERVICE = control_pb2.DESCRIPTOR.services_by_name["RouterAdmin"].full_name  # "duet.control.v1.RouterAdmin"
Members = Sequence[tuple[Any, ...]]  # (worker_id, endpoint), (worker_id, endpoint, role) or router.workers.MemberInfo


class MalformedRequest:
    """Stands in for a request message whose bytes did not parse (corrupt wire format, invalid
    UTF-8 in a string field): the handler answers INVALID_ARGUMENT instead of gRPC's own
    deserialization failure (an error log with a traceback, and UNKNOWN for the client)."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    @property
    def details(self) -> str:
        return f"request: not a valid {self.message_type} message ({self.error})"


def _tolerant(message_class: Any) -> Any:
    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, or a RuntimeError from the C parser
            return MalformedRequest(message_class.DESCRIPTOR.full_name, e)
    return deserialize


def add_duet_service(servicer: DuetServicer, server: grpc.aio.Server) -> None:
    """duet_pb2_grpc.add_DuetServicer_to_server, with request parsing that cannot raise."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_tolerant(duet_pb2.GenerateRequest),
            response_serializer=duet_pb2.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=_tolerant(duet_pb2.ListModelsRequest),
            response_serializer=duet_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(DUET_SERVICE, handlers),))
    server.add_registered_method_handlers(DUET_SERVICE, handlers)


# Trailing metadata of a stream a draining router hands off: "continue me on another router"
# (router/client.py resumes it there with duet.v1.ResumeFrom, also when it knows this one router only:
# behind a Service the next connection reaches another).
HANDOFF_METADATA_KEY = "duet-handoff"


class DuetServicer(duet_pb2_grpc.DuetServicer):
    def __init__(self, pipeline: Pipeline, max_n: int = 1) -> None:
        self.pipeline = pipeline
        self.fanout = FanOut(pipeline, max_n)  # GenerateRequest.n: router/fanout.py
        self.handing_off = False  # set while draining: single-choice streams end now (hand_off)
        # single-choice streams now awaiting their next response (a long prefill, a slow worker):
        # hand_off cancels these at once instead of waiting for a message that may be seconds away
        self._awaiting: set[asyncio.Task] = set()
        self._handed: set[asyncio.Task] = set()
        self.num_handed_off = 0

    def hand_off(self) -> None:
        """End every single-choice stream with the hand-off mark: those between messages at their
        next message, those awaiting one now (their worker call is cancelled, KV freed)."""
        self.handing_off = True
        for task in self._awaiting:
            self._handed.add(task)
            task.cancel()

    async def Generate(self, request: duet_pb2.GenerateRequest | MalformedRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[duet_pb2.GenerateResponse]:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            raise AssertionError("context.abort raises")
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        single = (request.n or 1) == 1
        task = asyncio.current_task()
        handed_off = False
        try:
            async with aclosing(self.fanout.generate(request, deadline=deadline)) as stream:
                responses = aiter(stream)
                while True:
                    if single and task is not None:
                        self._awaiting.add(task)
                    try:
                        response = await anext(responses)
                    except StopAsyncIteration:
                        break
                    finally:
                        self._awaiting.discard(task)
                    yield response
                    if self.handing_off and single and not response.HasField("finish_reason"):
                        handed_off = True
                        break  # closing the stream cancels the worker call
        except asyncio.CancelledError:
            if task not in self._handed:
                raise  # the client went away (or the server's grace ran out)
            handed_off = True  # our own cancel (hand_off): the stream ends with the hand-off mark below
        except RequestError as e:
            logger.info("request %s: %s %s", request.request_id or "(unnamed)", e.code.name, e.message)
            await context.abort(e.code, e.message)
        except Exception:  # a router bug: log it whole, tell the client no more than INTERNAL
            logger.exception("request %s: internal router error", request.request_id or "(unnamed)")
            await context.abort(grpc.StatusCode.INTERNAL, "internal router error (see the router's log)")
        finally:
            if task in self._handed:  # hand_off cancelled it: take that cancel back (whether it ended the
                self._handed.discard(task)  # stream here or the pipeline absorbed it into a retry)
                task.uncancel()
        if handed_off:
            self.num_handed_off += 1
            logger.info("request %s: handed off (the router is draining)", request.request_id or "(unnamed)")
            context.set_trailing_metadata(((HANDOFF_METADATA_KEY, "1"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this router is draining: continue the stream on "
                                "another router (duet.v1.ResumeFrom)")

    async def ListModels(self, request: duet_pb2.ListModelsRequest | MalformedRequest,
                         context: grpc.aio.ServicerContext) -> duet_pb2.ListModelsResponse:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            raise AssertionError("context.abort raises")
        return duet_pb2.ListModelsResponse(models=[
            duet_pb2.ModelInfo(name=c.name, is_default=c.is_default, max_model_len=c.max_model_len, parent=c.parent,
                               source=c.source) for c in self.pipeline.catalog.cards()])


class RouterServer:
    """A started router on the current event loop. Build it with ``start_router``."""

    def __init__(self, config: RouterConfig, model: ServedModel, others: Sequence[ServedModel] = ()) -> None:
        """model: the default model; others: the rest of ``config.served_models``, loaded."""
        self.config = config
        self.health = health.aio.HealthServicer()
        # The workers' reported prefix-cache holdings: the directory's polls feed it, the policy reads it
        # (router/prefix_index.py), so every router of a deployment routes on the same holdings.
        self.prefix_index = PrefixIndex()
        self.directory = WorkerDirectory(
            poll_interval_s=config.load_poll_interval_s, poll_timeout_s=config.load_poll_timeout_s,
            failure_threshold=config.worker_failure_threshold,
            stream_failure_cooldown_s=config.stream_failure_cooldown_s, on_health_change=self._on_health_change,
            prefix_index=self.prefix_index, watch_blocks=config.watch_block_events,
            multiplex=config.multiplex_worker_streams)
        self.metrics = RequestMetrics()  # per-pool histograms; router/prometheus.py exports them
        waker = None
        if config.membership_address is not None:  # a pool scaled to zero is woken by the controller
            address = config.membership_address
            waker = functools.partial(wake_pools, address, requester=f"router {config.address}")
        hold = WorkerHold(worker_wait_s=config.worker_wait_s, wake_timeout_s=config.wake_timeout_s, waker=waker,
                          on_wake_s=self.metrics.woke)
        policy = make_policy(config.policy, self.prefix_index, **config.policy_options)
        self.catalog = ModelCatalog([model, *others], AdapterRegistry(config.served_models))
        self.pipeline = Pipeline(config, model, self.directory, policy,
                                 AdmissionController(config.max_in_flight, config.max_queue), self.metrics, hold,
                                 self.catalog, holdings=self.prefix_index)
        # LoRA adapters at runtime, over gRPC (RouterAdmin) and HTTP, admin scope (router/adapter_admin.py)
        # with a controller, shared with every router through it (router/shared_adapters.py)
        self.shared_adapters = (SharedAdapters(config.membership_address, self.catalog.adapters)
                                if config.membership_address is not None else None)
        self.adapter_admin = AdapterAdmin(self.catalog, self.directory.snapshot, self.directory.stub_of,
                                          self.pipeline.serves, shared=self.shared_adapters)
        self.auth = BearerTokenInterceptor(TokenStore.load(config.auth_tokens_file)) if config.auth_tokens_file else None
        self._credentials = (server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
                             if config.tls_cert_file and config.tls_key_file else None)
        self._server = grpc.aio.server(
            interceptors=[self.auth] if self.auth else None,
            options=[("grpc.so_reuseport", 0),  # a busy port is an error, not shared
                     ("grpc.max_receive_message_length", config.max_request_bytes)])
        self.port = 0
        self._stopped = False
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._pin_task: asyncio.Future[None] | None = None
        self.membership: MembershipWatcher | None = None
        self.membership_version = 0
        self.rebalancer: Rebalancer | None = None
        if config.rebalance:
            self.rebalancer = Rebalancer(self.directory, RebalanceSettings(
                kv_gap=config.rebalance_kv_gap, tpot_ratio=config.rebalance_tpot_ratio,
                request_cooldown_s=config.rebalance_request_cooldown_s,
                pair_cooldown_s=max(config.rebalance_interval_s, 3 * config.load_poll_interval_s)),
                config.rebalance_interval_s)
        self.http: HttpApiServer | None = None
        if config.http:  # the OpenAI-compatible API: same pipeline, auth and metrics, its own port
            # imported here: a router with http_port 0 runs without the HTTP stack (fastapi, uvicorn)
            from router.http_api.app import HttpContext, create_app
            from router.http_api.server import HttpApiServer

            self.http = HttpApiServer(config, create_app(HttpContext(
                FanOut(self.pipeline, config.max_n), model, self.auth, self.serving,
                metrics_registry(self.stats, self.metrics.registry, model_name=config.model_name),
                config.max_request_bytes, self.catalog, self.adapter_admin)))

    async def _start(self, members: Members) -> None:
        self.servicer = DuetServicer(self.pipeline, self.config.max_n)
        add_duet_service(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        control_pb2_grpc.add_RouterAdminServicer_to_server(RouterAdminServicer(self.stats, self.adapter_admin),
                                                           self._server)
        reflection.enable_server_reflection([DUET_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self._server)
        await self._set_health(False)
        await self.health.set(ADMIN_SERVICE, health_pb2.HealthCheckResponse.SERVING)  # liveness: the process is up
        try:
            if self._credentials is not None:
                self.port = self._server.add_secure_port(self.config.address, self._credentials)
            else:
                self.port = self._server.add_insecure_port(self.config.address)
        except RuntimeError as e:
            raise RouterConfigError(f"port: cannot listen on {self.config.address} ({e}); is another "
                                    "router running there? pick another port (0 = any free port)") from None
        await self._server.start()
        if self.http is not None:
            await self.http.start()
        await self.directory.set_members(members)
        self._pin_task = asyncio.ensure_future(self._keep_pinned())
        if self.rebalancer is not None:
            self.rebalancer.start()
        if self.config.membership_address is not None:
            shared = self.shared_adapters
            self.membership = MembershipWatcher(self.config.membership_address, self._apply_members,
                                                watcher_name=f"router {self.address}",
                                                apply_adapters=lambda a, fresh: shared.apply(a, fresh=fresh))  # type: ignore[union-attr]  # set with membership_address
            self.membership.start()
            if not await self.membership.wait_first(self.config.membership_wait_s):
                logger.warning("router: no member list from the controller at %s within %.0f s; serving "
                               "what it has (%d workers) and still trying", self.config.membership_address,
                               self.config.membership_wait_s, len(self.directory.snapshot()))
        security = ("mTLS" if self.config.tls_client_ca_file else "TLS") if self.config.tls else "plaintext"
        logger.info("router serving %s on %s%s (%s%s; policy %s, %d workers, %d healthy)",
                    ", ".join(self.catalog.names) + (f" + {n} adapters" if (n := len(self.catalog.adapters.adapters()))
                                                     else ""),
                    self.address, f" (gRPC) and {self.http_url} (HTTP)" if self.http else "", security, ", bearer tokens" if self.auth else "", self.config.policy,
                    len(self.directory.snapshot()), sum(w.healthy for w in self.directory.snapshot()))

    @property
    def address(self) -> str:
        """Where a client on this machine connects (host:port)."""
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
        return f"[{host}]:{self.port}" if ":" in host and not host.startswith("[") else f"{host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        """host:port of the HTTP API (None when http_port is 0)."""
        if self.http is None:
            return None
        host, _, _ = self.address.rpartition(":")
        return f"{host}:{self.http.port}"

    @property
    def http_url(self) -> str | None:
        """The OpenAI base URL clients use, e.g. http://127.0.0.1:8000/v1 (None without HTTP)."""
        return None if self.http is None else f"{self.http.scheme}://{self.http_address}/v1"

    def serving(self) -> bool:
        """Ready: at least one healthy worker and not shutting down (what both health checks say)."""
        return not self._stopped and self.directory.any_healthy()

    async def set_members(self, members: Members) -> None:
        """Make the worker pool exactly ``members``; returns once newcomers have been polled."""
        await self.directory.set_members(members)

    async def _apply_members(self, members: Members, version: int) -> None:
        before = {w.worker_id for w in self.directory.snapshot()}
        await self.directory.set_members(members)
        self.membership_version = version
        after = {m[0] for m in members}
        if before != after:
            logger.info("membership v%d: %d workers (joined: %s; left: %s)", version, len(after),
                        ", ".join(sorted(after - before)) or "-", ", ".join(sorted(before - after)) or "-")

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {**self.pipeline.stats(), "membership_version": self.membership_version,
                 "load_reports": self.directory.load_reports(),
                 "drafter_reports": self.directory.drafters.load_reports()}
        if self.rebalancer is not None:  # shown among the request outcome counters
            stats["requests"] = {**stats["requests"], **self.rebalancer.counts}
        if self.auth is not None:  # shown among the request outcome counters (duet status)
            stats["requests"] = {**stats["requests"], **{f"auth_{k}": v for k, v in self.auth.rejected.items()}}
        return stats

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING and no new calls at once; in-flight streams get half of ``grace``
        seconds (default config.shutdown_grace_s) to finish here; single-choice gRPC streams still
        running then are handed off (they end with UNAVAILABLE and trailing metadata
        ``duet-handoff``, and the Duet client resumes them on another router at the exact token
        index); whatever is left at ``grace`` is cancelled; worker channels close."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        if self.rebalancer is not None:
            await self.rebalancer.stop()
        if self._pin_task is not None:
            self._pin_task.cancel()
            await asyncio.gather(self._pin_task, return_exceptions=True)
        if self.membership is not None:
            await self.membership.stop()
        grace = self.config.shutdown_grace_s if grace is None else grace
        stops = [self._server.stop(grace)] + ([self.http.stop(grace)] if self.http is not None else [])
        handoff = asyncio.ensure_future(self._hand_off_after(grace / 2))
        await asyncio.gather(*stops)
        handoff.cancel()
        await self.directory.close()
        logger.info("router on %s stopped", self.address)

    async def _keep_pinned(self) -> None:
        """Pinned adapters on every worker of their model (router/adapter_admin.py), every few polls."""
        while True:
            await asyncio.sleep(max(1.0, 5 * self.config.load_poll_interval_s))
            try:
                await self.adapter_admin.keep_pinned()
            except Exception:  # a bug: say so, keep the router serving
                logger.exception("router: keeping pinned adapters loaded failed")

    async def _hand_off_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        logger.info("router on %s: handing off the streams still running to the other routers", self.address)
        self.servicer.hand_off()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    def _on_health_change(self, serving: bool) -> None:
        if self._stopped:
            return  # shutting down: NOT_SERVING already, and closing the directory is not "no healthy worker"
        logger.info("router health -> %s", "SERVING" if serving else "NOT_SERVING (no healthy worker)")
        task = asyncio.ensure_future(self._set_health(None))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, serving: bool | None) -> None:
        # Reads the current state when it runs, so reordered updates still end on the truth.
        serving = self.directory.any_healthy() if serving is None else serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", DUET_SERVICE):
            await self.health.set(service, status)


async def start_router(config: RouterConfig, members: Members = (), *, tokenizer: Any | None = None) -> RouterServer:
    """Start the router on the running loop: load the tokenizer (unless given; a thread, so the
    loop keeps running), listen on ``config.address``, poll ``members`` once, return."""
    model = await asyncio.to_thread(ServedModel.load, config, tokenizer)
    others = [await asyncio.to_thread(ServedModel.load_spec, spec) for spec in config.models]
    try:
        server = RouterServer(config, model, others)
    except SecurityConfigError as e:
        raise RouterConfigError(str(e)) from None
    try:
        await server._start(members)
    except BaseException:
        await server.stop(0)
        raise
    return server


class RouterHandle:
    """A router running on its own thread and event loop (``serve_router``). Thread-safe,
    blocking methods; also a context manager that stops it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, server: RouterServer) -> None:
        self._loop = loop
        self._thread = thread
        self.server = server
        self.port = server.port
        self.address = server.address
        self.http_address = server.http_address  # host:port of the HTTP API, None when off
        self.http_url = server.http_url  # its OpenAI base URL (http://host:port/v1)

    def _run(self, coro: Any, timeout: float | None) -> Any:
        if not self._thread.is_alive():  # stopped: nothing would run the call, it would wait out its timeout
            coro.close()
            raise RuntimeError(f"the router on {self.address} is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def set_members(self, members: Members, timeout: float | None = 30.0) -> None:
        """Make the pool exactly ``members``; blocks until newcomers were polled. Call it from any
        thread but the router's own (there, ``await handle.server.set_members(...)``)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("RouterHandle.set_members called on the router's loop; await server.set_members()")
        self._run(self.server.set_members(list(members)), timeout)

    def stats(self) -> dict[str, Any]:
        async def get() -> dict[str, Any]:
            return self.server.stats()
        return self._run(get(), 10.0)

    def stop(self, grace: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self.server.stop(grace), None)
        finally:
            _stop_loop(self._loop, self._thread)

    def __enter__(self) -> RouterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_router(config: RouterConfig, members: Members = (), *, tokenizer: Any | None = None,
                 timeout: float = 120.0) -> RouterHandle:
    """Start the router on a daemon thread with its own event loop; returns once it listens."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"duet-router-{config.port}", daemon=True)
    thread.start()
    try:
        server = asyncio.run_coroutine_threadsafe(start_router(config, list(members), tokenizer=tokenizer),
                                                  loop).result(timeout)
    except BaseException:
        _stop_loop(loop, thread)
        raise
    return RouterHandle(loop, thread, server)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    async def cancel_rest() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    # Not loop.close(): grpc's completion-queue poller may still post late events to this loop,
    # which on a closed loop log "Event loop is closed" errors. A stopped loop just drops them.


def _parse_args(argv: list[str] | None) -> tuple[RouterConfig, list[tuple[str, str]]]:
    p = argparse.ArgumentParser(prog="python -m router.server", description="Run a Duet router against "
                                "already running workers (the cluster's `duet serve` does this for you).")
    p.add_argument("--tokenizer", required=True, help="checkpoint/tokenizer directory the workers serve")
    p.add_argument("--model-name", default=RouterConfig.model_name)
    p.add_argument("--host", default=RouterConfig.host)
    p.add_argument("--port", type=int, default=RouterConfig.port)
    p.add_argument("--http-port", type=int, default=RouterConfig.http_port, help="OpenAI-compatible HTTP API; 0 = off")
    p.add_argument("--policy", default=RouterConfig.policy)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--worker", action="append", default=[], metavar="ID=HOST:PORT", help="repeat per worker")
    p.add_argument("--membership", default=None, metavar="HOST:PORT",
                   help="follow the member list of the controller's Membership service at HOST:PORT "
                   "(`duet serve` prints it) instead of, or in addition to, fixed --worker entries")
    args = p.parse_args(argv)
    members = []
    for spec in args.worker:
        wid, sep, endpoint = spec.partition("=")
        if not sep or not wid or not endpoint:
            p.error(f"--worker {spec!r}: expected ID=HOST:PORT")
        members.append((wid, endpoint))
    try:
        config = RouterConfig(tokenizer_path=args.tokenizer, model_name=args.model_name, host=args.host,
                              port=args.port, http_port=args.http_port, policy=args.policy, max_model_len=args.max_model_len,
                              membership_address=args.membership)
    except RouterConfigError as e:
        p.error(str(e))
    return config, members


async def wait_for_stop_signal() -> None:
    """Return once the process gets SIGINT or SIGTERM (a foreground server's shutdown trigger)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _main(config: RouterConfig, members: list[tuple[str, str]]) -> None:
    server = await start_router(config, members)
    await wait_for_stop_signal()
    await server.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(*_parse_args(None)))
