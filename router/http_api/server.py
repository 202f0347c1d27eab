"""HttpApiServer: uvicorn serving the HTTP API app on the router's own event loop, beside grpc.aio.

It runs no loop, thread or process of its own: ``start()`` binds the port (a busy port is a
RouterConfigError naming ``http_port``) and starts uvicorn's listener on the running loop, so a
request handler calls the same Pipeline object the gRPC servicer does, on the same loop. uvicorn's
``serve()`` is not used because it installs its own SIGINT/SIGTERM handlers in the main thread; the
router's owner handles signals (cluster/deploy/serve.py, router/server.py).

TLS: the router's certificate and key; with a client CA, client certificates are required (mTLS),
as on the gRPC port.

Example::

    http = HttpApiServer(config, app)     # app = router.http_api.app.create_app(...)
    await http.start()                    # http://127.0.0.1:8000/v1/...
    await http.stop(grace=5.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any

import uvicorn

from router.config import RouterConfig, RouterConfigError

logger = logging.getLogger(__name__)


class HttpApiServer:
    def __init__(self, config: RouterConfig, app: Any) -> None:
        self.config = config
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=config.shutdown_grace_s,  # type: ignore[arg-type]  # uvicorn takes float seconds, typed int
            ssl_certfile=config.tls_cert_file, ssl_keyfile=config.tls_key_file, ssl_ca_certs=config.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_client_ca_file else ssl.CERT_NONE,
            h11_max_incomplete_event_size=64 * 1024))
        self._socket: socket.socket | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls else "http"

    async def start(self) -> None:
        self._socket = _bind(self.config.host, self.config.http_port)
        self.port = self._socket.getsockname()[1]
        self._uvicorn.config.load()
        self._uvicorn.lifespan = self._uvicorn.config.lifespan_class(self._uvicorn.config)  # "off": a no-op
        await self._uvicorn.startup(sockets=[self._socket])
        # uvicorn's tick loop: refreshes the Date header, nothing else (it ends when should_exit is set).
        self._ticker = asyncio.ensure_future(self._uvicorn.main_loop())

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, give open requests ``grace`` seconds, close the rest."""
        if self._socket is None:
            return
        if grace is not None:
            self._uvicorn.config.timeout_graceful_shutdown = max(grace, 0.001)  # type: ignore[assignment]  # as above
        self._uvicorn.should_exit = True
        if self._ticker is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._uvicorn.started:
            await self._uvicorn.shutdown(sockets=[self._socket])
        self._socket.close()
        self._socket = None


def _bind(host: str, port: int) -> socket.socket:
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    # proto IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP.
    # With Nagle on, an event written right after the response headers waits for the client's
    # delayed ACK (up to 40 ms on Linux): a stall before the first streamed token.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted connections
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict; a listener is
    try:
        sock.bind((bare, port))
    except OSError as e:
        sock.close()
        raise RouterConfigError(f"http_port={port}: cannot listen on {host}:{port} ({e.strerror}); is another "
                                "router running there? pick another port (0 turns the HTTP API off)") from None
    sock.set_inheritable(True)
    return sock
