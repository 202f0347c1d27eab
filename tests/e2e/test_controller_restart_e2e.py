"""The controller survives (issue 33, item 4): on an existing Ray cluster, ``duet serve --no-router``
(the Helm chart's head process) killed with SIGKILL mid-load loses no stream, and a new one with the
same config adopts the running worker (no reload: same endpoint, same incarnation) under the lease
the dead one left (cluster/deploy/registry.py); the router (``duet router --membership``) keeps
routing on its last member list meanwhile and follows the new controller once it is up."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "duet_restart"
PROMPT = "Write a short story about a lighthouse keeper and the sea."
TOKENS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A ``duet`` subprocess whose output lines are collected on a thread, so waits can time out."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DUET_", "RAY_")) or k == "DUET_CACHE_DIR"}
        # the session's Ray uses token auth, which Ray applies to an explicit address only with this set
        env.update(PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token")
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for line in self.lines[start:]:
                    if m := re.search(pattern, line):
                        return m
                start = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and start == len(self.lines):
                    raise AssertionError(f"no line matching {pattern!r} (exit {self.proc.poll()}):\n"
                                         + "".join(self.lines[-40:]))
                self._new.wait(min(left, 0.5))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _health(address: str) -> str:
    try:
        with grpc.insecure_channel(address) as channel:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _incarnation(endpoint: str) -> str:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).incarnation


async def _generate(address: str, n: int) -> list[list[int]]:
    async with DuetClient(address) as client:
        outs = await asyncio.gather(*(client.complete(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True,
                                                      timeout=180) for _ in range(n)))
    return [list(o.token_ids) for o in outs]


@pytest.mark.serial
def test_a_killed_controller_loses_no_stream_and_its_successor_adopts_the_worker(ray_cluster, smollm2_path, tmp_path):
    import ray

    gcs = ray.get_runtime_context().gcs_address
    controller_port, router_port = _free_port(), _free_port()
    config = tmp_path / "duet.yaml"
    config.write_text(
        f"model: {{name: {smollm2_path}}}\n"
        f"pools: [{{name: default, replicas: 1, cpus_per_replica: 1, engine: {{kv_cache_memory_bytes: 64MiB}}}}]\n"
        f"ray: {{address: '{gcs}', namespace: {NAMESPACE}}}\n"
        f"controller: {{port: {controller_port}, poll_interval_s: 0.2, start_timeout_s: 240}}\n"
        f"router: {{policy: least_loaded}}\n")
    serve = _Proc("serve", "--config", str(config), "--no-router")
    router = None
    second = None
    try:
        endpoint = serve.wait_for(r"controller: default-0 starting -> up at (\S+)", 240).group(1)
        serve.wait_for(r"duet: controller serving 1 workers", 60)
        before = _incarnation(endpoint)
        router = _Proc("router", "--config", str(config), "--membership", f"127.0.0.1:{controller_port}",
                       "--port", str(router_port))
        address = f"127.0.0.1:{router_port}"
        deadline = time.monotonic() + 120
        while _health(address) != "SERVING":
            assert time.monotonic() < deadline and router.proc.poll() is None, "".join(router.lines[-30:])
            time.sleep(0.2)
        [reference] = asyncio.run(_generate(address, 1))
        assert len(reference) == TOKENS

        # streams in flight while the controller is killed (no grace, as a crash) and while no controller runs
        results: list[list[list[int]]] = []
        load = threading.Thread(target=lambda: results.append(asyncio.run(_generate(address, 4))))
        load.start()
        time.sleep(1.0)
        serve.proc.kill()
        serve.proc.wait(timeout=30)
        load.join(timeout=240)
        assert results and results[0] == [reference] * 4  # nothing lost, nothing changed

        # the successor: waits out the dead one's lease, adopts the worker, serves membership again
        second = _Proc("serve", "--config", str(config), "--no-router")
        second.wait_for(r"pool default: adopted 1 recorded replicas \(0 created again", 120)
        second.wait_for(r"controller: default-0 starting -> up at " + re.escape(endpoint), 60)
        second.wait_for(r"duet: controller serving 1 workers", 60)
        assert _incarnation(endpoint) == before  # the same process: no reload, its KV cache intact
        router.wait_for(r"membership: watching the controller", 60, start=len(router.lines) - 1)
        assert asyncio.run(_generate(address, 2)) == [reference] * 2

        assert second.stop(signal.SIGINT) == 0, "".join(second.lines[-30:])
        assert "duet: stopped" in "".join(second.lines)
        deadline = time.monotonic() + 30  # a clean stop leaves no detached actor and no record behind
        while [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]:
            assert time.monotonic() < deadline, ray.util.list_named_actors(all_namespaces=True)
            time.sleep(0.5)
        from cluster.deploy.registry import Registry

        assert Registry(NAMESPACE).records() == []
    finally:
        for p in (second, router, serve):
            if p is not None:
                p.stop(signal.SIGKILL if p is serve else signal.SIGTERM, timeout=30)
        for a in ray.util.list_named_actors(all_namespaces=True):  # a failed run must not leak detached workers
            if a["namespace"] == NAMESPACE:
                ray.kill(ray.get_actor(a["name"], namespace=NAMESPACE), no_restart=True)
