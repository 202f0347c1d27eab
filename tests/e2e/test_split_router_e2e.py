"""The Kubernetes shape of a deployment, on the session's local Ray: the controller and pool without
a router (``start_deployment(with_router=False)``, what ``duet serve --no-router`` runs on the Ray
head) and a separate ``duet router`` process that follows its Membership service (what the Helm
chart's router Deployment runs), with the probes and the metrics endpoint the chart points at; a
second router process, and SIGTERM to the first while it carries streams: they are handed off and
the Duet client finishes each on the second with the tokens of an unbroken run, no error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config.duet import load_config
from cluster.deploy.serve import start_deployment
from router.client import complete
from testkit.ports import free_port
from testkit.router_kill import assert_like_unbroken, streams_through_a_kill

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 128  # per stream of the SIGTERM hand-off: long enough to be mid-way at the hand-off (1 s
# after the SIGTERM, at half of the 2 s grace: the margin 256 tokens and a 4 s grace gave, in half the tokens)


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


def _router_process(config_file: Path, membership: str, port: int, metrics_port: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUET_", "RAY_")) or k == "DUET_CACHE_DIR"}
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "router", "--config", str(config_file), "--membership",
         membership, "--port", str(port), "--metrics-port", str(metrics_port)],
        cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _sigterm_hands_streams_off(draining: subprocess.Popen[str], address: str, standby: str) -> None:
    """Three greedy streams through ``address`` (then ``standby``), SIGTERM to ``draining`` mid-way:
    every stream completes with the tokens of an unbroken run on ``standby``, and none fails."""
    cases = [(p, {"temperature": 0.0}) for p in ("The old clock in the hallway", "Write a short story about a fox:",
                                                 "List three rivers of Europe:")]
    with ThreadPoolExecutor(len(cases)) as pool:  # unbroken runs, the three at once (a batch, as below)
        expected = list(pool.map(lambda c: complete(c[0], target=standby, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                    timeout=300, **c[1]), cases))

    def sigterm() -> None:
        draining.send_signal(signal.SIGTERM)
        assert draining.wait(timeout=30) == 0

    got, at_kill = streams_through_a_kill(cases, [address, standby], sigterm, max_tokens=MAX_TOKENS, min_seen=2)
    assert max(at_kill) < MAX_TOKENS // 2, at_kill  # mid-way: the hand-off (at half of the 2 s grace) comes before the end
    assert_like_unbroken(cases, expected, got, at_kill, max_tokens=MAX_TOKENS, max_diverged=0, diverge_before_kill=True)


def test_controller_without_router_and_a_separate_router_process(ray_cluster, smollm2_path, tmp_path):
    config_file = tmp_path / "duet.yaml"  # the file the chart's ConfigMap would hold, in miniature
    config_file.write_text(f"model: {{name: {smollm2_path}}}\nrouter: {{policy: round_robin, max_queue: 7, http_port: 0, "
                           "shutdown_grace_s: 2}\n")
    config = load_config(config_file, env={}, overrides={
        "pool.engine.kv_cache_memory_bytes": "64MiB", "controller.port": 0, "router.port": free_port(), "router.http_port": 0,
        "ray.namespace": "duet_split", "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 240})
    with start_deployment(config, with_router=False) as d:
        assert d.router is None and d.address == d.membership.address
        for service in ("", "duet.control.v1.Membership"):  # the head's startup/liveness/readiness probes
            assert _health(d.membership.address, service) == "SERVING"

        port, metrics_port = free_port(), free_port()
        proc = _router_process(config_file, d.membership.address, port, metrics_port)
        standby_port = free_port()
        standby = _router_process(config_file, d.membership.address, standby_port, free_port())
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
            standby_address = f"127.0.0.1:{standby_port}"
            _wait(lambda: _health(standby_address) == "SERVING", 120, "the second router to be ready", standby)
            _sigterm_hands_streams_off(proc, address, standby_address)  # SIGTERM: exits 0 after the hand-off
        finally:
            for p in (proc, standby):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        log = proc.stdout.read()  # type: ignore[union-attr]
        assert "duet router: stopped" in log and "Traceback" not in log, log[-3000:]
        assert log.count("handed off (the router is draining)") == 3, log[-3000:]
    assert _health(d.membership.address) != "SERVING"  # stopped with the deployment
