"""``duet router``: a router in its own process (a Kubernetes Deployment), following a controller.

It reads the same Duet config as ``duet serve`` (the Helm chart mounts one ConfigMap into both),
so the router section -- policy and options, admission limits, shutdown grace -- and the model name
mean the same in both places. The model is resolved locally for its tokenizer files only (the
image bakes the weights or a volume mounts them). Membership comes from the controller's
duet.control.v1.Membership service (``--membership HOST:PORT``; in the chart, the head's
``<release>-duet-controller`` Service), which ``duet serve --no-router`` runs on the Ray head.

The context limit checked here is ``model.max_model_len`` (or the checkpoint's own limit): unlike
``duet serve`` this process cannot read the workers' KV budget before it serves, so a prompt that
fits the model but not a worker's KV pool is rejected by the worker (INVALID_ARGUMENT, passed
through) rather than by the router. Set ``model.max_model_len`` to make the router reject it first.

Example::

    duet router --config /etc/duet/duet.yaml --membership duet-controller:50052 --metrics-port 9090

It serves gRPC on ``router.port`` and the OpenAI-compatible HTTP API on ``router.http_port``
(``--http-port``; 0 = off), whose ``/metrics`` is the same registry as ``--metrics-port``'s
(that one stays open without a token, for scrapers inside the cluster).
"""

from __future__ import annotations

import logging
import signal
import threading

from cluster.config.duet import DuetConfig

logger = logging.getLogger(__name__)


def run_router_foreground(config: DuetConfig, membership: str, metrics_port: int = 0) -> int:
    """Serve the router (and /metrics when ``metrics_port`` > 0) until SIGINT/SIGTERM; returns 0."""
    from router.prometheus import serve_metrics
    from router.server import serve_router
    from workers.models.assets.resolve import resolve_model

    paths = {m.served: str(resolve_model(m.name)) for m in config.served_models}  # tokenizers only
    router_config = config.to_router_config(paths, membership_address=membership)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logger.info("duet router: %s received; shutting down", signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        handle = serve_router(router_config)
        metrics = (serve_metrics(metrics_port, handle.stats, handle.server.metrics.registry,
                                 model_name=router_config.model_name) if metrics_port else None)
        logger.info("duet router: serving %s on %s (gRPC)%s, members from %s%s",
                    ", ".join(m.name for m in router_config.served_models),
                    handle.address, f" and {handle.http_url} (OpenAI HTTP, /metrics)" if handle.http_url else "",
                    membership, f", metrics on :{metrics.server_port}/metrics" if metrics else "")
        try:
            stop.wait()
        finally:
            if metrics is not None:
                metrics.shutdown()
                metrics.server_close()
            handle.stop()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    logger.info("duet router: stopped")
    return 0
