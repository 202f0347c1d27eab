"""The Ray connection: an embedded local Ray (default) or an existing cluster.

    embedded   ``ray.address`` unset: ``ray.init(address="local", num_cpus=..., include_dashboard=False)``
               starts a fresh local Ray (GCS, raylet, workers) owned by this process; ``close()``
               shuts it down, so no Ray process outlives ``duet serve``. ``address="local"`` on
               purpose: a stray ``RAY_ADDRESS`` in the environment must not redirect an embedded start
               (``RAY_ADDRESS`` is read into ``ray.address`` by cluster.config.duet instead, visibly).
    existing   ``ray.address`` = "auto" | "host:6379" | "ray://host:10001": join that cluster as a
               driver; ``close()`` only disconnects, the cluster keeps running. Every node needs the
               duet package installed (the worker actors import ``workers``).
    reused     Ray is already initialised in this process (tests, notebooks): use it as is and leave
               it alone on ``close()``.

Signals: ray.init installs its own SIGTERM handling; ``connect`` puts the caller's SIGINT/SIGTERM
handlers back afterwards (see ``_restore``), so ``duet serve`` keeps its clean shutdown. An embedded
Ray's GCS and raylet share ``duet serve``'s process group, so a SIGTERM sent to the whole group
(``timeout``, systemd's default KillMode, a supervisor's stop-as-group) stops them at the same moment
as ``duet serve``; ``reachable()`` lets the shutdown see that and skip the steps that would wait on
them (an actor call then blocks until Ray's 60 s GCS timeout kills the process).

Example::

    conn = connect(RaySection(num_cpus=2))
    print(conn.kind, conn.address, conn.session_dir)   # embedded 10.0.0.5:6379 /tmp/ray/session_...
    conn.close()
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from cluster.config.duet import RaySection

logger = logging.getLogger(__name__)


class RayConnectionError(RuntimeError):
    """Ray could not be started or reached; the message says which address and what to check."""


@dataclass
class RayConnection:
    kind: str  # "embedded" | "existing" | "reused"
    address: str  # the GCS address ("" if unknown)
    session_dir: str  # e.g. /tmp/ray/session_2026-...; every process of this Ray names it
    namespace: str
    _closed: bool = False

    @property
    def owned(self) -> bool:
        """True if ``close()`` disconnects (we called ray.init)."""
        return self.kind != "reused"

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether the GCS still accepts a TCP connection (True when its address is unknown: assume so)."""
        host, sep, port = self.address.rpartition(":")
        if not sep or not port.isdigit():
            return True
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except OSError:
            return False

    def close(self) -> None:
        """Embedded: stop the local Ray (all its processes). Existing: disconnect. Reused: nothing."""
        if self._closed or not self.owned:
            return
        self._closed = True
        import ray

        ray.shutdown()
        logger.info("ray: %s", "embedded local Ray stopped" if self.kind == "embedded" else "disconnected")


def connect(section: RaySection, *, log_to_driver: bool = True) -> RayConnection:
    """Start or join Ray as ``section`` says (see the module docstring)."""
    import ray

    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        logger.info("ray: already initialised in this process (namespace %r); using it", ctx.namespace)
        return RayConnection("reused", ctx.gcs_address, "", section.namespace)
    kwargs: dict[str, Any]
    if section.address is None:
        kwargs = dict(address="local", num_cpus=section.num_cpus, include_dashboard=False)
        kind = "embedded"
    else:
        kwargs = dict(address=section.address)
        kind = "existing"
    saved = _signal_handlers()
    try:
        info = ray.init(namespace=section.namespace, log_to_driver=log_to_driver, **kwargs)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"the Ray cluster at {section.address!r}" if section.address else "an embedded local Ray"
        fix = ("check ray.address / --ray-address / RAY_ADDRESS (is `ray start --head` running there?)"
               if section.address else "see the Ray logs under /tmp/ray/session_latest/logs")
        raise RayConnectionError(f"cannot start or reach {where}: {e}; {fix}") from e
    finally:
        _restore(saved)
    no_auto_init()
    address_info = info.address_info  # type: ignore[attr-defined]  # a RayContext; ray.init is typed BaseContext
    conn = RayConnection(kind, address_info.get("gcs_address", ""), address_info.get("session_dir", ""),
                         section.namespace)
    cpus = ray.cluster_resources().get("CPU", 0)
    logger.info("ray: %s cluster at %s (%g CPUs, session %s)", kind, conn.address, cpus, conn.session_dir)
    return conn


def no_auto_init() -> None:
    """Turn off Ray's "start a local Ray on the first API call" in this process. Duet connects
    explicitly (``connect``); after ``close`` a call still in flight on another thread (the
    controller's poll, a teardown step the shutdown stopped waiting for) would otherwise start a
    fresh local Ray with every CPU of the machine, and that stray cluster kept ``duet serve`` from
    exiting. Off, such a call raises instead. (Ray reads RAY_ENABLE_AUTO_CONNECT once, at import.)"""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore(saved: dict[int, Any]) -> None:
    """Put back the caller's SIGINT/SIGTERM handlers. ray.init replaces SIGTERM's with its own
    (``sys.exit`` in Python, and underneath it a C++ crash handler that aborts the process with no
    cleanup, leaving the embedded Ray's processes behind); ``duet serve`` needs its own handler
    to shut down cleanly. Re-installing a Python handler re-installs it at the C level too."""
    for signum, handler in saved.items():
        if handler is not None:
            signal.signal(signum, handler)
