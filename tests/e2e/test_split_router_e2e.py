"""The Kubernetes shape of a deployment, on the session's local Ray: the controller and pool without
a router (``start_deployment(with_router=False)``, what ``duet serve --no-router`` runs on the Ray
head) and a separate ``duet router`` process that follows its Membership service (what the Helm
chart's router Deployment runs), with the probes and the metrics endpoint the chart points at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from router.client import complete
from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _health(address: str, service: str = "") -> str:
    try:
        with grpc.insecure_channel(address) as channel:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    except grpc.RpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"duet router exited ({proc.returncode}) while waiting for {what}:\n"
                                 + proc.stdout.read()[-3000:])  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)


def test_controller_without_router_and_a_separate_router_process(ray_cluster, smollm2_path, tmp_path):
    config_file = tmp_path / "duet.yaml"  # the file the chart's ConfigMap would hold, in miniature
    config_file.write_text(f"model: {{name: {smollm2_path}}}\nrouter: {{policy: round_robin, max_queue: 7}}\n")
    config = load_config(config_file, env={}, overrides={
        "pool.engine.kv_cache_memory_bytes": "64MiB", "controller.port": 0, "router.port": free_port(), "router.http_port": 0,
        "ray.namespace": "duet_split", "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    with start_deployment(config, with_router=False) as d:
        assert d.router is None and d.address == d.membership.address
        for service in ("", "duet.control.v1.Membership"):  # the head's startup/liveness/readiness probes
            assert _health(d.membership.address, service) == "SERVING"

        port, metrics_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DUET_", "RAY_")) or k == "DUET_CACHE_DIR"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "router", "--config", str(config_file), "--membership",
             d.membership.address, "--port", str(port), "--metrics-port", str(metrics_port)],
            cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        address = f"127.0.0.1:{port}"
        try:
            _wait(lambda: _health(address) == "SERVING", 120, "the router to be ready", proc)
            assert _health(address, "duet.control.v1.RouterAdmin") == "SERVING"  # its liveness probe
            out = complete("The capital of France is", target=address, max_tokens=4, temperature=0, timeout=60)
            assert out.usage.completion_tokens == 4 and out.text
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(metrics) for s in family.samples}
            model = (("model_name", "SmolLM2-135M-Instruct"),)
            assert samples[("duet_router_requests_total", model)] == 1.0
            assert samples[("duet_router_max_queue", model)] == 7.0  # the router section of the shared config applies
            assert samples[("duet_router_workers", tuple(sorted((("healthy", "true"),) + model)))] == 1.0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = proc.stdout.read()  # type: ignore[union-attr]
        assert "duet router: stopped" in log and "Traceback" not in log, log[-3000:]
    assert _health(d.membership.address) != "SERVING"  # stopped with the deployment
