"""Helpers the gpu-check sections share: engine construction, greedy runs, decode timing, worker
processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_check import models
from benchmarks.gpu_check.harness import Ctx


def dtype_for(ctx: Ctx, want: torch.dtype = torch.bfloat16) -> torch.dtype:
    """bf16 on CUDA (the serving dtype); fp32 on CPU (what the CPU kernels run)."""
    return want if ctx.cuda else torch.float32


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint(ctx: Ctx, shape: str, dtype: torch.dtype) -> Path:
    return models.build(shape, Path(ctx.work), dtype=dtype, device=ctx.device, tiny=ctx.tiny)


def engine(path: Path, ctx: Ctx, dtype: torch.dtype, *, max_num_seqs: int = 64, cuda_graphs: bool = False,
           graph_sizes: tuple[int, ...] | None = None, kv_bytes: int | None = None, speculative=None):
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from workers.build import build_engine

    cfg = EngineConfig(model=str(path), dtype=dname(dtype), device=ctx.device, max_model_len=1024,
                       cache=CacheConfig(kv_cache_memory_bytes=kv_bytes or kv_budget(ctx)),
                       scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, 32 * max_num_seqs),
                                                 max_num_seqs=max_num_seqs),
                       cuda_graphs=cuda_graphs, cuda_graph_batch_sizes=graph_sizes,
                       speculative=speculative or SpeculativeConfig())
    return build_engine(cfg)


def kv_budget(ctx: Ctx) -> int:
    """KV pool per engine: 1 GiB on a GPU, 64 MiB on CPU (tiny models; several engines share the RAM)."""
    return 1 << 30 if ctx.cuda else 64 << 20


def greedy(eng, prompts: list[list[int]], max_tokens: int, prefix: str = "g") -> list[list[int]]:
    """Greedy continuations of all prompts, batched by the engine."""
    from workers.sampling_params import SamplingParams

    out: dict[str, list[int]] = {}
    ids = [eng.add_request(f"{prefix}{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
           for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[r] for r in ids]


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def decode_tok_s(eng, ctx: Ctx, batch: int, prompt_len: int, new_tokens: int, seed: int = 7) -> float:
    """Decode throughput: ``batch`` requests prefilled first, then the decode steps timed alone."""
    from workers.sampling_params import SamplingParams

    prompts = models.prompts(batch, eng.spec.vocab_size, prompt_len, prompt_len + 1, seed=seed)
    for i, p in enumerate(prompts):
        eng.add_request(f"t{seed}-{i}", p, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    while eng.stats().num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()  # prefill (and the first token)
    sync(ctx)
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        n += sum(len(o.new_token_ids) for o in eng.step())
    sync(ctx)
    return n / (time.perf_counter() - t0)


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def strict_fp32() -> None:
    """fp32 means fp32: no TF32 matmuls (HF and Duet alike)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class WorkerProcess:
    """A Duet worker gRPC service (workers/server/service.py) in its own process, without Ray.

    ``wait=False`` returns once the process is started; ``wait_ready()`` then waits until it serves,
    so a section can start several workers (and do its own work) while they load::

        with WorkerProcess(path, ctx, dtype, name="p", wait=False) as p, WorkerProcess(..., wait=False) as d:
            reference = ...            # in this process, while both load
            p.wait_ready(); d.wait_ready()
    """

    def __init__(self, path: Path, ctx: Ctx, dtype: torch.dtype, kv_backend: str = "auto", name: str = "w",
                 timeout_s: float = 120.0, wait: bool = True) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.ready_file = Path(ctx.work) / f"{name}-{os.getpid()}-{time.monotonic_ns()}.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check.worker_proc", "--model", str(path), "--device", ctx.device,
               "--dtype", dname(dtype), "--kv-backend", kv_backend, "--kv-bytes", str(kv_budget(ctx)), "--ready", str(self.ready_file), "--id", name]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the worker serves (at most ``timeout_s`` from its start); sets endpoint, worker_id, incarnation."""
        deadline = self.started + self.timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with code {self.proc.returncode} before serving")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"worker {self.name} not serving after {self.timeout_s:.0f} s")
            time.sleep(0.2)
        info = json.loads(self.ready_file.read_text())
        self.endpoint, self.worker_id, self.incarnation = info["endpoint"], info["worker_id"], info["incarnation"]

    def close_stdin(self) -> None:
        """Ask the worker to stop (it stops when its stdin closes) without waiting for it."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # it exited meanwhile (broken pipe)
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.close_stdin()
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - it did not stop in time
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
