"""`make bench-peers` without the peers: each server's command line and environment
(benchmarks/peers/servers.py), the server selection of run.py, and the process handling
(benchmarks/peers/process.py) on a real stand-in server: a Python HTTP server whose child outlives
a plain kill of the parent."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers.process import ServerFailed, ServerProcess, descendants, free_port, start_time, tree_cpu_s
from benchmarks.peers.run import build_parser, select_servers
from benchmarks.peers.servers import ALL_SERVERS, MODEL_ID, MissingPeer, Paths, parse_servers, server_spec


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    """Every peer present: empty stand-in files where the programs and the GGUF would be."""
    for rel in ("vllm/bin/python", "llamacpp/build/bin/llama-server", "smollm2.gguf"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    model = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    model.mkdir(parents=True)
    return Paths(repo=tmp_path, duet_python=tmp_path / ".venv/bin/python", model_dir=model,
                 gguf=tmp_path / "smollm2.gguf", vllm_python=tmp_path / "vllm/bin/python",
                 llama_server=tmp_path / "llamacpp/build/bin/llama-server")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name, 3) + 1]  # after "taskset -c CORES"


def test_every_server_is_pinned_to_the_same_cores_and_threads(paths: Paths):
    for name in ALL_SERVERS:
        spec = server_spec(name, paths, threads=1, slots=64, cores="0")
        argv = spec.argv(port=8123)
        assert argv[:3] == ["taskset", "-c", "0"], name
        assert "8123" in argv and "{port}" not in " ".join(argv), name
        assert "1 thread (core 0)" in spec.how, name
        assert "127.0.0.1" in argv, name


@pytest.mark.parametrize("dtype,torch_dtype,quant", [("fp32", "float32", "none"), ("q4", "float32", "q4"),
                                                     ("int8", "float32", "int8"), ("bf16", "bfloat16", "none")])
def test_duet_command_line(paths: Paths, dtype: str, torch_dtype: str, quant: str):
    spec = server_spec(f"duet-{dtype}", paths, threads=2, slots=32, cores="0-1")
    argv = spec.argv(port=9000)
    assert argv[3:7] == [str(paths.duet_python), "-m", "cluster.cli", "serve"]
    assert _flag(argv, "--dtype") == torch_dtype and _flag(argv, "--quantization") == quant
    assert _flag(argv, "--cpus-per-replica") == "2" and _flag(argv, "--http-port") == "9000"
    assert _flag(argv, "--model") == MODEL_ID and _flag(argv, "--host") == "127.0.0.1"
    assert spec.env["OMP_NUM_THREADS"] == "2" and spec.env["PYTHONPATH"] == str(paths.repo)
    assert spec.env["DUET_CACHE_DIR"] == str(paths.model_dir.parent.parent)  # the directory vLLM loads


def test_duet_does_not_inherit_duet_or_ray_settings(paths: Paths):
    spec = server_spec("duet-q4", paths, threads=1, slots=8, cores="0")
    env = spec.environ({"DUET_CONFIG": "x.yaml", "DUET_QUANTIZATION": "int8", "RAY_ADDRESS": "auto",
                        "DUET_CACHE_DIR": "/elsewhere", "HOME": "/root"})
    assert "DUET_CONFIG" not in env and "DUET_QUANTIZATION" not in env and "RAY_ADDRESS" not in env
    assert env["HOME"] == "/root" and env["DUET_CACHE_DIR"] == str(paths.model_dir.parent.parent)


@pytest.mark.parametrize("dtype,vllm_dtype", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_vllm_command_line(paths: Paths, dtype: str, vllm_dtype: str):
    spec = server_spec(f"vllm-{dtype}", paths, threads=1, slots=64, cores="0")
    argv = spec.argv(port=9001)
    assert argv[3:6] == [str(paths.vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == str(paths.model_dir) and _flag(argv, "--served-model-name") == MODEL_ID
    assert _flag(argv, "--dtype") == vllm_dtype and _flag(argv, "--max-num-seqs") == "64"
    assert spec.env["VLLM_TARGET_DEVICE"] == "cpu" and spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert spec.env["HF_HUB_OFFLINE"] == "1"


def test_llamacpp_has_a_slot_per_stream_and_continuous_batching(paths: Paths):
    spec = server_spec("llamacpp-q4_1", paths, threads=1, slots=64, cores="0", ctx_per_slot=256)
    argv = spec.argv(port=9002)
    assert argv[3] == str(paths.llama_server) and _flag(argv, "-m") == str(paths.gguf)
    assert _flag(argv, "-t") == "1" and _flag(argv, "-tb") == "1"
    assert _flag(argv, "--parallel") == "64" and "--cont-batching" in argv
    assert _flag(argv, "-c") == str(64 * 256) and _flag(argv, "--alias") == MODEL_ID
    assert spec.health_path == "/health" and "64 slots" in spec.how
    assert "--no-repack" in argv  # its AMX path crashes on an AMX machine
    assert "--no-repack" not in server_spec("llamacpp-q4_1", paths, threads=1, slots=8, cores="0",
                                            llamacpp_repack=True).argv(port=9003)


def test_a_missing_peer_says_which_command_makes_it(paths: Paths):
    paths.vllm_python.unlink()
    paths.llama_server.unlink()
    with pytest.raises(MissingPeer, match="envs.sh vllm"):
        server_spec("vllm-bf16", paths, threads=1, slots=8, cores="0")
    with pytest.raises(MissingPeer, match="envs.sh llamacpp"):
        server_spec("llamacpp-q4_1", paths, threads=1, slots=8, cores="0")
    server_spec("duet-q4", paths, threads=1, slots=8, cores="0")  # Duet needs no peer environment


def test_server_names_are_checked():
    assert parse_servers("duet-q4, vllm-bf16") == ["duet-q4", "vllm-bf16"]
    with pytest.raises(ValueError, match="duet-fp16"):
        parse_servers("duet-q4,duet-fp16")
    with pytest.raises(ValueError):
        parse_servers(" , ")


def test_duet_dtypes_replace_the_duet_servers_in_place():
    assert select_servers("duet-fp32,vllm-bf16,llamacpp-q4_1", "q4,bf16") == [
        "duet-q4", "duet-bf16", "vllm-bf16", "llamacpp-q4_1"]
    assert select_servers("vllm-bf16,duet-fp32,llamacpp-q4_1", "int8") == ["vllm-bf16", "duet-int8", "llamacpp-q4_1"]
    assert select_servers("vllm-bf16", None) == ["vllm-bf16"]
    with pytest.raises(ValueError):
        select_servers("vllm-bf16", "fp8")


def test_cli_defaults_match_the_issue():
    args = build_parser().parse_args([])
    assert args.concurrency == [1, 8, 32, 64] and args.input_tokens == 128 and args.output_tokens == 64
    assert args.threads == 1 and args.server_cores == "0" and args.client_cores == "1"
    assert build_parser().parse_args(["--concurrency", "2,4"]).concurrency == [2, 4]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--concurrency", "0,8"])


# --- the process handling, on a real stand-in server -------------------------------------------

# Serves 200 on /health after a delay, and starts a grandchild that leaves the process group (its
# own session), as Ray's processes may: stop() must end it too.
STANDIN = r"""
import http.server, os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _wait_for(cond, timeout_s: float = 10.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_server_is_health_checked_and_its_whole_tree_is_stopped(tmp_path: Path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", STANDIN, str(port), "0.5"], dict(os.environ),
                           tmp_path / "standin.log", port, "/health")
    with server:
        assert server.wait_healthy(timeout_s=30) >= 0.0
        assert _wait_for(lambda: len(descendants(server.proc.pid)) >= 1)
        tree = server.note_tree()
        starts = {p: start_time(p) for p in tree}
        assert tree_cpu_s(server.proc.pid) >= 0.0
    assert server.proc is None
    # Every process of the tree is gone (or its pid now names another, later process).
    assert _wait_for(lambda: all(start_time(p) != starts[p] for p in tree))


def test_a_server_that_exits_fails_with_its_log(tmp_path: Path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                           dict(os.environ), tmp_path / "exit.log", port, "/health")
    with server, pytest.raises(ServerFailed, match="no model here"):
        server.wait_healthy(timeout_s=30)


def test_stop_runs_when_the_body_raises(tmp_path: Path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", STANDIN, str(port), "0"], dict(os.environ),
                           tmp_path / "standin.log", port, "/health")
    with pytest.raises(KeyboardInterrupt), server:
        server.wait_healthy(timeout_s=30)
        pid, started = server.proc.pid, start_time(server.proc.pid)
        raise KeyboardInterrupt
    assert _wait_for(lambda: start_time(pid) != started)
