"""Where a batch-1 decode step of the Qwen2.5-1.5B shape (bf16, CUDA graphs on) spends its time:
wall time per step, GPU busy time per step (sum of kernel times from torch.profiler), the top GPU
kernels, the top host-side calls (cProfile, cumulative), and the same wall time with graphs off.
Figures only (no targets): it tells the next optimisation where to look. A chrome trace of a few
steps is written beside the JSON when $OUT is set.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from benchmarks.gpu_check import common

CUDA_ONLY = True
BUDGET_S = 100.0
PROMPT, STEPS = 32, 60


def _one_request_engine(eng, tag: str) -> None:
    from benchmarks.gpu_check import models
    from workers.sampling_params import SamplingParams

    [p] = models.prompts(1, eng.spec.vocab_size, PROMPT, PROMPT + 1, seed=5)
    eng.add_request(tag, p, SamplingParams(temperature=0, max_tokens=4 * STEPS + 40, ignore_eos=True))
    for _ in range(12):  # prefill + warm-up decode steps
        eng.step()


def _step_times(eng, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        out.append(time.perf_counter() - t0)
    return out


def _profiled(eng) -> dict:
    """GPU kernels (torch.profiler) and host calls (cProfile) of batch-1 decode steps."""
    from torch.profiler import ProfilerActivity, profile

    out: dict = {}
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _step_times(eng, 20)
            torch.cuda.synchronize()
        events = prof.key_averages()
        dev = [e for e in events if "CUDA" in str(getattr(e, "device_type", ""))]
        gpu_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in dev)
        out["gpu_busy_ms_per_step"] = round(gpu_us / 20 / 1e3, 3)
        for key, sort in (("top_gpu_kernels", "self_device_time_total"), ("top_cpu_ops", "self_cpu_time_total")):
            try:
                out[key] = events.table(sort_by=sort, row_limit=25, max_name_column_width=70)
            except Exception:  # noqa: BLE001 - older torch names it self_cuda_time_total
                out[key] = events.table(sort_by=sort.replace("device", "cuda"), row_limit=25, max_name_column_width=70)
        if os.environ.get("OUT"):
            prof.export_chrome_trace(os.path.join(os.environ["OUT"], "decode_profile_trace.json"))
    except Exception as e:  # noqa: BLE001 - the host profile and wall times still count
        out["profiler_error"] = repr(e)
    pr = cProfile.Profile()
    pr.enable()
    _step_times(eng, STEPS)
    pr.disable()
    for key, sort, n in (("host_profile_cumulative", "cumulative", 45), ("host_profile_tottime", "tottime", 30)):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(n)
        out[key] = buf.getvalue()[-9000:]
    return out


def run(ctx) -> dict:
    dtype = torch.bfloat16
    path = common.checkpoint(ctx, "qwen2.5-1.5b", dtype)
    out: dict = {}
    for graphs in (True, False):
        eng = common.engine(path, ctx, dtype, max_num_seqs=8, cuda_graphs=graphs, graph_sizes=(1, 8) if graphs else None)
        _one_request_engine(eng, f"p{graphs}")
        torch.cuda.synchronize()
        walls = _step_times(eng, STEPS)
        key = "graphs" if graphs else "eager"
        out[f"{key}_step_ms_median"] = round(1e3 * statistics.median(walls), 3)
        if graphs:
            out.update(_profiled(eng))
        del eng
        torch.cuda.empty_cache()
    out["checks"] = {"measured": out["graphs_step_ms_median"] > 0}
    out["summary"] = (f"b1 step {out['graphs_step_ms_median']} ms with graphs (GPU busy {out.get('gpu_busy_ms_per_step')} ms), "
                      f"{out['eager_step_ms_median']} ms eager")
    return out
