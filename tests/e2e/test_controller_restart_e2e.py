"""The controller survives (issue 33, item 4): on an existing Ray cluster, ``duet serve --no-router``
(the Helm chart's head process) killed with SIGKILL mid-load loses no stream, and a new one with the
same config adopts the running worker (no reload: same endpoint, same incarnation) under the lease
the dead one left (cluster/deploy/registry.py); the router (``duet router --membership``) keeps
routing on its last member list meanwhile and follows the new controller once it is up.

The deployment runs as the chart's does: SLO autoscaling on (1 s rounds, metrics from the router's
``--metrics-port``) and a standby replica. The successor adopts the standby as a standby (not
created again, not a second one, not promoted), its autoscaler resumes from the state the dead one
saved (cluster/autoscale/persist.py) and decides no scaling in either process (the load is far
below the profile's capacity: any decision would be a restart artefact)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient
from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "duet_restart"
PROMPT = "Write a short story about a lighthouse keeper and the sea."
TOKENS = 48


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


def _workers(namespace: str) -> list[str]:
    """The named worker actors of the deployment (serving and standby)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith("default-"))


# Far above what the test's few streams ask for: the autoscaler has no reason to scale either way.
PROFILE = {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "colocated",
           "slo": {"ttft_p90_s": 60.0, "tpot_p90_s": 60.0},
           "capacity": {"requests_per_s": 100.0, "mean_prompt_tokens": 16.0, "mean_output_tokens": float(TOKENS)}}
OUTAGE_S = 20  # at most, from the kill to the successor's restore (its lease wait is 10 s)
SCALED = r"autoscaler: default (\d+ -> \d+|standby \d+ -> \d+)"


def _saved_state(ok, timeout: float = 60.0) -> dict:
    """The autoscaler state the controller saved in Ray's KV (cluster/autoscale/persist.py), once ``ok(it)``."""
    from cluster.deploy.registry import Registry

    store = Registry(NAMESPACE).state_store("autoscaler")
    deadline = time.monotonic() + timeout
    while not ok(payload := store.load() or {"saved_at": 0.0}):
        assert time.monotonic() < deadline, payload
        time.sleep(0.2)
    return payload


def _readings(payload: dict) -> list[float]:
    """The wall-clock moments of the metrics window's readings (saved as ages at saved_at)."""
    return [payload["saved_at"] - age for age, _ in payload.get("provider", {}).get("readings", [])]


def _incarnation(endpoint: str) -> str:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).incarnation


async def _generate(address: str, n: int) -> list[list[int]]:
    async with DuetClient(address) as client:
        outs = await asyncio.gather(*(client.complete(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True,
                                                      timeout=180) for _ in range(n)))
    return [list(o.token_ids) for o in outs]


def test_a_killed_controller_loses_no_stream_and_its_successor_adopts_the_worker(ray_cluster, smollm2_path, tmp_path):
    import ray

    gcs = ray.get_runtime_context().gcs_address
    controller_port, router_port, metrics_port = free_port(), free_port(), free_port()
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    config = tmp_path / "duet.yaml"
    config.write_text(
        f"model: {{name: {smollm2_path}}}\n"
        f"pools: [{{name: default, replicas: 1, standby_replicas: 1, cpus_per_replica: 1, "
        f"engine: {{kv_cache_memory_bytes: 64MiB}}}}]\n"
        f"ray: {{address: '{gcs}', namespace: {NAMESPACE}}}\n"
        f"controller: {{port: {controller_port}, poll_interval_s: 0.2, start_timeout_s: 240}}\n"
        f"router: {{policy: least_loaded, http_port: 0}}\n"  # no fixed port: other modules run beside it
        f"autoscaling: {{enabled: true, interval_s: 1, window_buckets: 60, latency_buckets: 2, horizon_s: 2, "
        f"up_cooldown_s: 2, down_cooldown_s: 2, down_interval_s: 1, "
        f"metrics_urls: ['http://127.0.0.1:{metrics_port}/metrics'], "
        f"pools: [{{pool: default, slo_ttft_ms: 60000, slo_tpot_ms: 60000, profile: {tmp_path / 'profile.json'}, "
        f"min_replicas: 1, max_replicas: 2}}]}}\n")
    serve = _Proc("serve", "--config", str(config), "--no-router")
    router = None
    second = None
    try:
        endpoint = serve.wait_for(r"controller: default-0 starting -> up at (\S+)", 240).group(1)
        serve.wait_for(r"duet: controller serving 1 workers", 60)
        serve.wait_for(r"duet: autoscaling default every 1 s", 60)
        before = _incarnation(endpoint)
        router = _Proc("router", "--config", str(config), "--membership", f"127.0.0.1:{controller_port}",
                       "--port", str(router_port), "--metrics-port", str(metrics_port))
        address = f"127.0.0.1:{router_port}"
        deadline = time.monotonic() + 120
        while _health(address) != "SERVING":
            assert time.monotonic() < deadline and router.proc.poll() is None, "".join(router.lines[-30:])
            time.sleep(0.2)
        [reference] = asyncio.run(_generate(address, 1))
        assert len(reference) == TOKENS
        serve.wait_for(r"controller: default-1 \S+ -> standby", 240)  # it loaded meanwhile
        workers = _workers(NAMESPACE)
        assert workers == ["default-0", "default-1"], workers
        # the autoscaler's metrics window (readings of the router's /metrics) outspans the outage to come
        # (the successor waits out the dead one's lease, 10 s, then starts): it is carried over, not dropped
        _saved_state(lambda p: len(r := _readings(p)) > 1 and r[-1] - r[0] >= OUTAGE_S)

        # streams in flight while the controller is killed (no grace, as a crash) and while no controller runs
        results: list[list[list[int]]] = []
        load = threading.Thread(target=lambda: results.append(asyncio.run(_generate(address, 4))))
        load.start()
        time.sleep(1.0)
        assert serve.proc.poll() is None and not any(re.search(SCALED, line) for line in serve.lines), \
            "".join(serve.lines[-30:])
        serve.proc.kill()
        killed_at = time.time()
        serve.proc.wait(timeout=30)
        load.join(timeout=240)
        assert results and results[0] == [reference] * 4  # nothing lost, nothing changed

        # the successor: waits out the dead one's lease, adopts the worker, serves membership again
        second = _Proc("serve", "--config", str(config), "--no-router")
        # both replicas adopted, the standby as a standby: none created again, no third one
        second.wait_for(r"pool default: adopted 2 recorded replicas \(0 created again: their actors were gone; "
                        r"1 standby\)", 120)
        second.wait_for(r"controller: default-0 starting -> up at " + re.escape(endpoint), 60)
        second.wait_for(r"controller: default-1 \S+ -> standby", 60)
        second.wait_for(r"duet: controller serving 1 workers", 60)
        restored = second.wait_for(r"autoscaler: restored the state saved (\d+) s ago \(([^)]*)\)", 60)
        assert restored.group(2) == "policy, provider", restored.group(0)
        assert int(restored.group(1)) < OUTAGE_S and "not restoring" not in "".join(second.lines), restored.group(0)
        # its saves go on from the dead one's: the window still holds readings from before the kill
        after = _saved_state(lambda p: p["saved_at"] > killed_at)
        assert "default" in after["policy"] and min(_readings(after)) < killed_at - 1, after
        assert _incarnation(endpoint) == before  # the same process: no reload, its KV cache intact
        router.wait_for(r"membership: watching the controller", 60, start=len(router.lines) - 1)
        assert asyncio.run(_generate(address, 2)) == [reference] * 2
        time.sleep(3)  # a few of the successor's rounds, on the router's live metrics
        assert _workers(NAMESPACE) == workers  # nothing leaked, nothing duplicated
        lines = "".join(second.lines)
        assert not re.search(SCALED, lines) and "added replica" not in lines, lines[-3000:]
        assert "promoted from standby" not in lines and "released" not in lines, lines[-3000:]

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
