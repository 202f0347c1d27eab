"""The ``duet`` command as a user runs it: every --help, ``serve --dry-run``, and one real
``duet serve`` subprocess (its own embedded Ray, 1 worker) that ``duet generate`` and
``duet status`` talk to, then SIGINT: exit code 0 and no Ray process of that instance left."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from testkit.ports import free_port

DUET = [sys.executable, "-m", "cluster.cli"]
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """This environment without anything that would point a subprocess at another deployment."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("DUET_") and k != "DUET_CACHE_DIR") and not k.startswith("RAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DUET, *args], cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args", [[], ["serve"], ["router"], ["generate"], ["status"], ["bench"], ["prepare-model"]])
def test_help_runs_and_is_fast(args):
    t0 = time.monotonic()
    r = _run(*args, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: duet" in r.stdout
    assert time.monotonic() - t0 < 10
    if not args:
        for command in ("serve", "router", "generate", "status", "bench", "prepare-model"):
            assert command in r.stdout
        assert "sample prompts" not in r.stdout  # the pre-serving description is gone
    if args == ["serve"]:
        assert "--config" in r.stdout and "--ray-address" in r.stdout and "RAY_ADDRESS" in r.stdout
        assert "--no-router" in r.stdout
    if args == ["router"]:
        assert "--membership" in r.stdout and "--metrics-port" in r.stdout and "DUET_MEMBERSHIP" in r.stdout


def test_serve_dry_run_merges_and_validates(tmp_path):
    cfg = tmp_path / "duet.yaml"
    cfg.write_text("router: {port: 6000}\npools: [{replicas: 3}]\n")
    r = subprocess.run([*DUET, "serve", "--config", str(cfg), "--port", "6001", "--dry-run"], cwd=ROOT,
                       env={**_env(), "DUET_REPLICAS": "2"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "port: 6001" in r.stdout and "replicas: 2" in r.stdout
    r = _run("serve", "--port", "99999", "--dry-run")
    assert r.returncode == 2
    assert "router.port=99999 (from flag --port)" in r.stderr and "Traceback" not in r.stderr


def test_router_bad_flags_are_one_line_errors():
    r = _run("router", "--metrics-port", "70000")
    assert r.returncode == 2 and "--metrics-port=70000: must be in 0..65535" in r.stderr and "Traceback" not in r.stderr
    r = _run("router", "--port", "99999")
    assert r.returncode == 2 and "router.port=99999 (from flag --port)" in r.stderr


def test_busy_port_and_missing_router_fail_fast_with_one_line(smollm2_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = _run("serve", "--model", str(smollm2_path), "--port", str(port))
        assert r.returncode == 1 and time.monotonic() - t0 < 30
        assert f"router.port={port}: cannot listen" in r.stderr and "Traceback" not in r.stderr
        assert "Started a local Ray" not in r.stderr  # checked before anything was started
        r = _run("serve", "--model", str(smollm2_path), "--port", "0", "--http-port", str(port))
        assert r.returncode == 1 and f"router.http_port={port}: cannot listen" in r.stderr, r.stderr
        assert "--http-port" in r.stderr and "Traceback" not in r.stderr
        r = _run("generate", "--target", f"127.0.0.1:{port}", "Hello", "--timeout", "3")
    assert r.returncode == 1 and r.stderr.startswith("duet: error: ") and "Traceback" not in r.stderr


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{p.name}: {cmd[:120]}")
    return found


class _Lines:
    """Collects a subprocess's output lines on a thread, so waits can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            self._q.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n" + "".join(self.lines[-40:]))
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            m = re.search(pattern, line)
            if m:
                return m


def test_serve_generate_status_and_ctrl_c(smollm2_path):
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [*DUET, "serve", "--model", str(smollm2_path), "--port", str(port), "--http-port", str(http_port),
         "--controller-port", "0", "--replicas", "1", "--kv-cache-memory", "64MiB", "--ray-num-cpus", "1"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _Lines(proc)
    try:
        ray_line = out.wait_for(r"ray: embedded cluster at (\S+) .*session (\S+)\)", timeout=120)
        gcs_address, session_dir = ray_line.group(1), ray_line.group(2)
        out.wait_for(rf"duet: ready\. gRPC on 127\.0\.0\.1:{port}, OpenAI HTTP API on "
                     rf"http://127\.0\.0\.1:{http_port}/v1\. Try: duet generate --target 127\.0\.0\.1:{port}", timeout=240)

        gen = _run("generate", "--target", f"127.0.0.1:{port}", "Hello", "--max-tokens", "5", "--temperature", "0")
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip(), "no text streamed"
        assert "5 tokens, length" in gen.stderr

        # An explicit address (not "auto": this test session may run its own Ray too); the embedded Ray
        # uses token auth, which Ray applies to an explicit address only with RAY_AUTH_MODE=token.
        status = _run("status", "--target", f"127.0.0.1:{port}", "--ray-address", gcs_address, "--json",
                      RAY_AUTH_MODE="token")
        assert status.returncode == 0, status.stderr
        s = json.loads(status.stdout)
        assert s["router"]["health"] == "SERVING" and "ray_error" not in s, s
        stats = s["router"]["stats"]  # the router's own counters (RouterAdmin), membership from the controller
        assert stats["requests"] == 1 and stats["counters"]["finish_length"] == 1 and stats["in_flight"] == 0
        assert stats["membership_version"] >= 1 and [w["worker_id"] for w in stats["workers"]] == ["default-0"]
        assert [(w["worker_id"], w["health"]) for w in s["workers"]] == [("default-0", "SERVING")]
        assert s["workers"][0]["load"]["kv_blocks_used"] == 0
        # the OpenAI-compatible API of the same router (both addresses were printed above)
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json={"prompt": "Hello", "max_tokens": 5,
                                                                            "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text

        assert any("raylet" in p for p in _processes_mentioning(session_dir))  # the leak check below can see it
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(out.lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(out.lines)
    assert "duet: stopped" in text and "Traceback" not in text, text[-3000:]
    # Nothing of this deployment's Ray is left: its raylet, gcs_server and workers all name its session
    # dir in their command lines (other Ray clusters on the machine are not this test's business).
    deadline = time.monotonic() + 15
    while _processes_mentioning(session_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_mentioning(session_dir)


def test_serve_stops_promptly_when_a_group_sigterm_stops_its_ray_too(smollm2_path):
    """``timeout``, systemd and supervisors signal the whole process group: the embedded Ray's GCS and
    raylet get the SIGTERM with ``duet serve``. Its shutdown sees the GCS gone and skips the actor
    drain (an actor call would block until Ray's 60 s GCS timeout kills the process): it stops
    cleanly, well within a 30 s grace, and leaves no process of its Ray behind."""
    port = free_port()
    proc = subprocess.Popen(
        [*DUET, "serve", "--model", str(smollm2_path), "--port", str(port), "--http-port", "0",
         "--controller-port", "0", "--replicas", "1", "--kv-cache-memory", "64MiB", "--ray-num-cpus", "1"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = _Lines(proc)
    try:
        session_dir = out.wait_for(r"ray: embedded cluster at \S+ .*session (\S+)\)", timeout=120).group(1)
        out.wait_for(r"duet: ready\.", timeout=240)
        os.killpg(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("still running 60 s after the SIGTERM:\n" + "".join(out.lines[-40:])) from None
        assert code == 0, "".join(out.lines[-40:])
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(out.lines)
    assert "GCS at" in text and "is gone" in text and "duet: stopped" in text, text[-3000:]
    assert took < 30, f"stopping took {took:.1f} s"
    deadline = time.monotonic() + 15
    while _processes_mentioning(session_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_mentioning(session_dir)
