"""``duet serve``: bring a whole deployment up in this process, and take it down again cleanly.

The order, in ``start_deployment`` (each step undone, in reverse, if a later one fails):

    1. the ports it will listen on are free (a second; a busy one fails before anything else), then
       preflight (cluster/deploy/preflight.py): resolve the model and each drafter and check that their
       architecture runs with each pool's parallel sizes and quantization, before anything starts
       (the router needs the tokenizer files too)
    2. Ray: start an embedded local Ray or join ``ray.address`` (cluster/deploy/ray_conn.py); pools that
       leave cpus_per_replica unset get their share of the embedded Ray's CPUs (``resolve_cpus``)
    3. the pools, in config order: each its own placement group + worker actors (cluster/deploy/pools.py);
       a disaggregated deployment has a prefill pool and a decode pool, sized and placed apart; a
       drafter pool's replicas are drafter actors that the router hands to the pools naming it. On an
       existing cluster (``ray.address``) they are detached and recorded in Ray, under a lease this
       process holds (cluster/deploy/registry.py): a ``duet serve`` restarted after a crash (or a
       restarted head pod) adopts the running workers instead of loading new ones
    4. the controller starts every worker and waits until they serve (cluster/deploy/controller.py);
       it also loads each pool's ``standby_replicas`` (loaded, unrouted: promoted first on a scale-up)
    5. the controller's membership service (duet.control.v1.Membership on ``controller.port``,
       cluster/deploy/membership_service.py), whose Wake wakes pools scaled to zero through the
       deployment's actuator (cluster/deploy/wake.py) when a router holds a request for one
    6. the router (``router.replicas`` of them, active-active on consecutive ports: router i serves
       gRPC on ``router.port + i`` and HTTP on ``router.http_port + i``), each on a background thread
       with the workers as its first members; every one polls every worker, so all see the same load
       and the same reported prefix holdings (router/prefix_index.py); each follows the
       membership service over gRPC from then on (joins, leaves, restarts; no router restart), the
       same way a router in its own process or pod does (``duet router --membership``). With
       ``with_router=False`` (``duet serve --no-router``, what the Helm chart's Ray head runs) this
       step is skipped: routers run elsewhere (their own Kubernetes Deployment) and follow step 5.
    7. with ``autoscaling.enabled``: the SLO autoscaler's loop on a background thread
       (cluster/autoscale/loop.py): metrics from this process's routers (all of them), or from
       ``autoscaling.metrics_urls`` (cluster/autoscale/metrics.py), decisions by
       cluster/autoscale/slo.py, applied by the actuator ``autoscaling.actuator`` names
       (cluster/deploy/kuberay_actuator.py): ``ray`` (cluster/deploy/ray_actuator.py: new replicas start and
       join; removed ones drain first) or ``kubernetes`` (the same, plus the pool's KubeRay worker
       group resized: pods added before the actors, removed after the drain). On an existing
       cluster each round's state is saved beside the replica records (cluster/autoscale/persist.py):
       a restarted ``duet serve`` restores it (cooldowns, offsets, metrics window, standby counts),
       and its adopted standby replicas stay standby.

``Deployment.stop()`` undoes it: autoscaler (no more resizing) -> router (NOT_SERVING, streams get ``router.shutdown_grace_s`` to
finish) -> membership service -> controller (no restarts any more) -> workers (drain, abort,
kill) -> placement group -> Ray (shut down if embedded; otherwise only disconnected). Nothing Duet
started is left running.

The router's context limit is the workers' effective one: the smaller of ``model.max_model_len``
(or the checkpoint's ``max_position_embeddings``) and what one worker's KV pool holds, read from a
running worker's load report (``kv_blocks_total x kv_block_size``), so the router rejects an
over-long prompt itself instead of forwarding it.

Example (what tests do; the CLI wraps this in ``run_foreground``)::

    config = load_config("duet.yaml")
    with start_deployment(config) as d:
        print(d.address)               # 127.0.0.1:50051 (gRPC)
        print(d.http_url)              # http://127.0.0.1:8000/v1 (OpenAI-compatible HTTP; router.http_port)
        print(generate_text("Hello", target=d.address, max_tokens=8))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from cluster.config.duet import DuetConfig
from cluster.deploy.cpu_share import resolve_cpus
from cluster.deploy.controller import Controller
from cluster.deploy.membership_service import MembershipService, serve_membership
from cluster.deploy.pool_metrics import PoolStateCollector
from cluster.deploy.pools import WorkerPool, create_pool
from cluster.deploy.ray_conn import RayConnection, connect
from cluster.deploy.registry import Registry
from cluster.deploy.wake import PoolWaker

logger = logging.getLogger(__name__)


class ServeError(RuntimeError):
    """The deployment could not be brought up; the message says what failed and what to check."""


@dataclass
class Deployment:
    """A running deployment. ``address`` is where clients connect (host:port)."""

    config: DuetConfig
    ray: RayConnection
    pools: list[WorkerPool] = field(default_factory=list)
    controller: Controller | None = None
    membership: MembershipService | None = None
    router: Any = None  # router.server.RouterHandle: the first of ``routers``
    routers: list[Any] = field(default_factory=list)  # every router this process runs (router.replicas)
    autoscaler: Any = None  # cluster.autoscale.loop.AutoscaleLoop, with autoscaling enabled
    registry: Registry | None = None  # an existing Ray cluster: the replica records and controller lease
    actuator: Any = None  # autoscaling.actuator's (cluster/deploy/kuberay_actuator.py), else a RayActuator
    waker: Any = None  # cluster.deploy.wake.PoolWaker: wakes pools scaled to zero for the routers
    model_path: Path | None = None  # the default model's checkpoint
    max_model_len: int | None = None  # the default model's effective context limit
    model_paths: dict[str, Path] = field(default_factory=dict)  # served name -> checkpoint, every model
    max_model_lens: dict[str, int] = field(default_factory=dict)  # served name -> effective context limit
    cpus_note: str = ""  # what resolve_cpus chose, for the startup line
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        """The router's host:port; without a router, the membership service's."""
        if self.router is not None:
            return self.router.address
        assert self.membership is not None, "address of a deployment that is not up"
        return self.membership.address

    @property
    def http_url(self) -> str | None:
        """The router's OpenAI base URL (http://host:port/v1); None without a router or with http_port 0."""
        return self.router.http_url if self.router is not None else None

    @property
    def addresses(self) -> list[str]:
        """Every router's gRPC host:port (router.replicas of them, consecutive ports)."""
        return [r.address for r in self.routers]

    @property
    def pool(self) -> WorkerPool | None:
        """The first pool (``pools[0]``), as ``pool.*`` config keys address it."""
        return self.pools[0] if self.pools else None

    def stop(self) -> None:
        """Router, controller, workers, placement group, Ray (if embedded). Idempotent; each step
        runs even if an earlier one failed."""
        if self._stopped:
            return
        self._stopped = True
        steps = [("autoscaler", lambda: self.autoscaler.stop()),
                 ("router", lambda: [r.stop() for r in self.routers]),
                 ("membership", lambda: self.membership.stop()),  # type: ignore[union-attr]  # None: skipped below
                 ("controller", lambda: self._unless_ray_gone("the controller's poll", self.controller.stop)),  # type: ignore[union-attr]  # None: skipped below
                 ("pools", lambda: self._unless_ray_gone("the worker actors' drain", self._stop_pools)), ("registry", lambda: self.registry.release()),  # type: ignore[union-attr]  # None: skipped below
                 ("ray", self.ray.close)]
        for name, step in steps:
            if name != "ray" and not getattr(self, name):
                continue
            try:
                step()
            except Exception:  # keep tearing down; a leftover is worse than a log line
                logger.exception("shutdown: stopping the %s failed", name)
        logger.info("duet: stopped")

    def _stop_pools(self) -> None:
        # the controller's view of which replicas run, not a GCS lookup per replica (WorkerPool.shutdown)
        running = self.controller.running() if self.controller is not None else None
        for pool in self.pools:
            pool.shutdown(running=running)

    def _unless_ray_gone(self, what: str, step: Callable[[], None]) -> None:
        """Run a teardown step that calls Ray, unless Ray's GCS goes away meanwhile: a SIGTERM to the
        whole process group (``timeout``, systemd, supervisors) stops the embedded Ray with us, and a
        Ray call then blocks until Ray's 60 s GCS timeout kills this process. The step runs on a
        thread this one stops waiting for once the GCS no longer accepts connections (the actors
        stop with their raylet then)."""
        done = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - re-raised below, where stop() logs it
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name=f"duet-stop-{what.split()[-1]}", daemon=True).start()
        while not done.wait(0.5):
            if not self.ray.reachable():
                self.registry = None  # nothing to release in a Ray that is gone (and each call would block)
                logger.warning("shutdown: Ray's GCS at %s is gone (the signal reached it too?); not waiting for "
                               "%s (the actors stop with their raylet)", self.ray.address, what)
                return
        if failed:
            raise failed[0]

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_deployment(config: DuetConfig, *, router_overrides: dict[str, Any] | None = None,
                     log_to_driver: bool = True, with_router: bool = True,
                     sources: dict[str, str] | None = None) -> Deployment:
    """Bring the deployment up (see the module docstring); returns once the router listens (or,
    with ``with_router=False``, once the membership service does).

    router_overrides: extra RouterConfig fields (tests shorten its poll intervals). sources: where
    each config key came from (``load_config(sources=...)``), for the preflight's messages."""
    from cluster.deploy.preflight import preflight

    if config.autoscaling.enabled and not with_router and not config.autoscaling.metrics_urls:
        raise ServeError("autoscaling.enabled with no router in this process (--no-router): set "
                         "autoscaling.metrics_urls to the routers' /metrics (`duet router --metrics-port`)")
    if with_router:  # before minutes of startup (and the model checks)
        for i in range(config.router.replicas):
            _check_port_free(config.router.host, config.router.port + i if config.router.port else 0,
                             "router.port" + (f" + {i} (router.replicas)" if i else ""), "--port")
            _check_port_free(config.router.host, config.router.http_port + i if config.router.http_port else 0,
                             "router.http_port" + (f" + {i} (router.replicas)" if i else ""), "--http-port",
                             off_hint="0 turns the HTTP API off")
    _check_port_free(config.controller.host, config.controller.port, "controller.port", "--controller-port")
    checked = preflight(config, sources)  # after the ports: they fail in a second, the model checks take a few
    ray_conn = connect(config.ray, log_to_driver=log_to_driver)
    deployment = Deployment(config, ray_conn, model_path=checked.model_path, model_paths=checked.model_paths)
    try:
        deployment.config, deployment.cpus_note = resolve_cpus(config, _embedded_cpus(ray_conn))
        logger.info("duet: %s", deployment.cpus_note)
        _start(deployment, router_overrides or {}, with_router)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def _start(d: Deployment, router_overrides: dict[str, Any], with_router: bool) -> None:
    from router.server import serve_router

    config = d.config
    if d.ray.kind != "embedded":  # workers outlive this process; a restarted duet serve adopts them
        d.registry = Registry(config.ray.namespace)
        d.registry.acquire()
    for section in config.pools:
        engine_config = (config.to_drafter_engine_config(section) if section.role == "drafter"
                         else config.to_engine_config(section))
        d.pools.append(create_pool(section, engine_config, config.ray.namespace,
                                   embedded=d.ray.kind == "embedded",
                                   placement_timeout_s=config.controller.placement_timeout_s, registry=d.registry))
    d.controller = Controller(d.pools, poll_interval_s=config.controller.poll_interval_s,
                              start_timeout_s=config.controller.start_timeout_s)
    for section in config.pools:  # loaded from the controller's first poll on, beside the serving replicas
        d.controller.set_standby(section.name, section.standby_replicas)
    if config.autoscaling.enabled and d.registry is not None:  # the standby counts the dead controller's autoscaler set
        from cluster.autoscale.persist import standby_targets

        for pool, n in standby_targets(d.registry.state_store("autoscaler").load(),
                                       config.to_autoscaler_config()).items():
            d.controller.set_standby(pool, n)
    d.controller.start()
    replicas = sum(not p.is_standby(r.worker_id) and p.drain_until(r.worker_id) is None  # adopted standby or
                   for p in d.pools for r in list(p.replicas))                              # draining: stay so
    logger.info("duet: waiting for %d workers to load %s", replicas,
                ", ".join(m.name for m in config.served_models))
    if not d.controller.wait_ready(replicas, timeout=config.controller.start_timeout_s):
        up = d.controller.members()
        problems = "; ".join(f"{r['worker_id']}: {r['state']} {r['last_error']}".strip()
                             for r in d.controller.describe() if r["state"] != "up")
        if not up:
            raise ServeError(f"no worker came up within controller.start_timeout_s="
                             f"{config.controller.start_timeout_s:g} s ({problems})")
        logger.warning("duet: %d of %d workers up; continuing without the rest (%s)", len(up), replicas, problems)
    targets = [(wid, endpoint) for wid, endpoint, role in d.controller.members_with_roles() if role != "drafter"]
    if not targets:
        raise ServeError("only drafter replicas came up; no worker to serve requests "
                         f"({'; '.join(str(r['worker_id']) + ': ' + str(r['state']) for r in d.controller.describe())})")
    assert d.model_path is not None  # resolved before the pools start
    default = config.served_models[0].served
    for model in config.served_models:  # a prompt must fit the KV of every pool serving its model
        mine = [ep for wid, ep in targets if (d.controller.model_of(wid) or default) == model.served]
        if not mine:
            raise ServeError(f"no worker of model {model.served} came up "
                             f"({'; '.join(str(r['worker_id']) + ': ' + str(r['state']) for r in d.controller.describe())})")
        d.max_model_lens[model.served] = min(effective_max_model_len(d.model_paths[model.served], model.max_model_len,
                                                                     ep) for ep in mine)
    d.max_model_len = d.max_model_lens[default]
    d.actuator = _make_actuator(d)
    d.waker = PoolWaker(d.actuator, {p.name: p.role for p in config.pools})
    d.membership = serve_membership(d.controller, config.controller.host, config.controller.port, wake=d.waker.wake,
                                    adapters_store=d.registry.state_store("adapters") if d.registry is not None else None)
    if not with_router:
        _start_autoscaler(d)
        logger.info("duet: controller serving %d workers of %s (context %d tokens), no router here; routers "
                    "follow the member list at %s (`duet router --membership HOST:%d`)", len(d.controller.members()),
                    ", ".join(d.max_model_lens), d.max_model_len, d.membership.address, d.membership.port)
        return
    router_config = config.to_router_config({name: str(path) for name, path in d.model_paths.items()},
                                            d.max_model_lens, membership_address=d.membership.address,
                                            **router_overrides)
    for i in range(config.router.replicas):  # active-active, consecutive ports (0 stays "any free port")
        d.routers.append(serve_router(dataclasses.replace(
            router_config, port=router_config.port + i if router_config.port else 0,
            http_port=router_config.http_port + i if router_config.http_port else 0), d.controller.router_members()))
        d.routers[-1].server.metrics.registry.register(PoolStateCollector(d.controller))  # standby etc. on /metrics
    d.router = d.routers[0]
    _start_autoscaler(d)
    logger.info("duet: serving %s on %s (gRPC)%s (%d workers, policy %s, context %d tokens, %s; members from %s)",
                ", ".join(m.name for m in router_config.served_models), ", ".join(d.addresses),
                f" and {', '.join(r.http_url for r in d.routers)} (OpenAI HTTP)" if d.router.http_url else "",
                len(d.controller.members()), router_config.policy, d.max_model_len, d.cpus_note, d.membership.address)


def _make_actuator(d: Deployment) -> Any:
    """The actuator of ``autoscaling.actuator`` (the Ray one when autoscaling is off: it wakes pools
    scaled to zero and promotes standby replicas for the membership service's Wake)."""
    from cluster.deploy.kuberay_actuator import make_actuator
    from cluster.deploy.ray_actuator import RayActuator

    a = d.config.autoscaling
    assert d.controller is not None  # started before the actuator
    if a.enabled:
        return make_actuator(a, d.pools, d.controller)
    return RayActuator(d.pools, d.controller, drain_grace_s=a.drain_grace_s)


def _start_autoscaler(d: Deployment) -> None:
    """Step 7 of the module docstring (nothing when autoscaling is off)."""
    from cluster.autoscale.loop import AutoscaleLoop, SLOAutoscaler
    from cluster.autoscale.metrics import PrometheusWindows, source_for
    from router.prometheus import metrics_registry

    a = d.config.autoscaling
    if not a.enabled:
        return
    sources = [source_for(url) for url in a.metrics_urls]
    if not sources:  # checked in start_deployment: without metrics_urls, this process runs the router
        sources = [metrics_registry(r.stats, r.server.metrics.registry).collect for r in d.routers]
    d.autoscaler = AutoscaleLoop(SLOAutoscaler(d.config.to_autoscaler_config()),
                                 PrometheusWindows(sources, window_buckets=a.window_buckets,
                                                   latency_buckets=a.latency_buckets),
                                 d.actuator, interval_s=a.interval_s,
                                 store=d.registry.state_store("autoscaler") if d.registry is not None else None)
    d.autoscaler.restore()  # a restarted controller's: cooldowns, offsets and the window go on
    d.autoscaler.start()
    logger.info("duet: autoscaling %s every %g s (metrics from %s)", ", ".join(p.pool for p in a.pools), a.interval_s,
                ", ".join(a.metrics_urls) or f"the {len(d.routers)} router(s) of this process")


def _embedded_cpus(conn: RayConnection) -> int | None:
    """The CPUs an embedded Ray offers (None when joined to an existing cluster)."""
    if conn.kind != "embedded":
        return None
    import ray

    return int(ray.cluster_resources().get("CPU", 1))


def _check_port_free(host: str, port: int, key: str, flag: str, off_hint: str = "0 = any free port") -> None:
    """Fail fast if something already listens on a port Duet binds only after workers loaded."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            raise ServeError(f"{key}={port}: cannot listen on {host}:{port} ({e.strerror}); is another "
                             f"`duet serve` running? pick another {flag} ({off_hint})") from None


def effective_max_model_len(model_path: Path, configured: int | None, worker_endpoint: str) -> int:
    """min(configured or the checkpoint's max_position_embeddings, the checkpoint's limit, what
    one worker's KV pool holds) -- the rule the engine applies (workers/engine/engine.py)."""
    import grpc

    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    model_limit = int(json.loads((model_path / "config.json").read_text())["max_position_embeddings"])
    with grpc.insecure_channel(worker_endpoint) as channel:
        report = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    return min(configured or model_limit, model_limit, report.kv_blocks_total * report.kv_block_size)


def run_foreground(config: DuetConfig, *, with_router: bool = True, sources: dict[str, str] | None = None) -> int:
    """``duet serve``: start, log where it listens, serve until SIGINT/SIGTERM, stop cleanly.

    Both signals raise KeyboardInterrupt in the main thread, also while starting (a SIGTERM during
    model loading must not leave Ray running); once shutdown begins further signals are ignored
    (logged), so a second Ctrl-C cannot cut the cleanup short. Returns the exit code: 0 after a
    clean shutdown."""
    def interrupt(signum: int, frame: object) -> None:
        logger.info("duet: %s received; shutting down", signal.Signals(signum).name)
        raise KeyboardInterrupt

    def ignore(signum: int, frame: object) -> None:
        logger.warning("duet: %s received while shutting down; still shutting down", signal.Signals(signum).name)

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    deployment: Deployment | None = None
    try:
        try:
            deployment = start_deployment(config, with_router=with_router, sources=sources)
            if with_router:
                logger.info("duet: ready. gRPC on %s, OpenAI HTTP API on %s. Try: duet generate --target %s "
                            "\"Hello\"%s   (Ctrl-C stops)", deployment.address, deployment.http_url or "(off)",
                            deployment.address, f" or curl {deployment.http_url}/models" if deployment.http_url else "")
            else:
                logger.info("duet: ready (no router). Membership at %s   (Ctrl-C stops)", deployment.address)
            threading.Event().wait()  # until a signal raises KeyboardInterrupt here
        except KeyboardInterrupt:
            pass  # logged by the handler; the finally below shuts down
        finally:
            for s in old:
                signal.signal(s, ignore)
            if deployment is not None:
                deployment.stop()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 0
