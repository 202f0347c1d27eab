"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

# Triton kernels can only run in its interpreter here (no GPU), and `@triton.jit` reads this when a
# kernel module is first imported -- which any test may trigger (e.g. dispatch tests with fake CUDA
# tensors) -- so set it for the whole session, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

# dtype 'auto' picks bfloat16 on a CPU with AVX512-BF16 or AMX (kernels/cpu_features.py): the suite's
# comparisons with float32 references (transformers, HF logprobs, greedy outputs) then run float32 on
# every CPU, as on CI machines without those instructions; bf16 has its own tests with an explicit
# dtype (tests/kernels/test_bf16_kernels.py; bf16 vs fp32 quality in tests/workers/models/test_quant_model.py,
# the fused bf16 stack in test_decode_stack.py, auto on such a CPU in test_dtype_auto.py) and the
# resolution itself is tested with the CPU fact injected (tests/workers/engine/test_device.py).
# Subprocesses and a Ray cluster started by the session inherit it.
os.environ.setdefault("DUET_CPU_BF16", "0")


def _xdist_worker_threads() -> int | None:
    """Torch threads for one pytest-xdist worker: the CPUs shared out among the workers (None outside
    xdist). Each worker otherwise starts one OpenMP thread per CPU, so ``-n 2`` on 2 cores runs 4
    spinning threads on 2 cores and a CPU-bound test takes several times as long as alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 1:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // workers)


# Before torch is first imported: OpenMP reads it once; subprocesses (gang ranks, Ray, gpu-check's
# sections) inherit it. An explicit OMP_NUM_THREADS wins.
if (_threads := _xdist_worker_threads()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import pytest  # noqa: E402 - after OMP_NUM_THREADS is set

from workers.models.assets.prepare import prepare_smollm2  # noqa: E402 - it imports torch


@pytest.fixture(autouse=True)
def _restore_cpu_kernels_switch():
    """Every test starts with the process-wide C++ kernel switch as the session had it: an engine
    built with ``cpu_kernels=False`` turns the kernels off for its whole process (workers/engine/
    model_runner.py, one model per worker process), which must not leak into the next test of the
    same pytest worker (a later fused-stack test would silently run the module path)."""
    from kernels import cpu_kernels_enabled, set_cpu_kernels_enabled

    before = cpu_kernels_enabled()
    yield
    set_cpu_kernels_enabled(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model as a safetensors checkpoint (converted once per machine, then cached)."""
    return prepare_smollm2()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster per test session (2 CPUs, no dashboard), always shut down. It offers
    two units of the custom resource ``duet_test_slot`` (what a node of one pool offers in a
    multi-pool cluster; tests/cluster/deploy/test_pool_placement.py) and two logical GPUs (Ray assigns
    their ids to ranks that reserve them; there is no CUDA behind them: tests/cluster/deploy/test_pool_gpus.py)."""
    import ray

    _start_session_ray()
    try:
        yield ray
    finally:
        ray.shutdown()


SESSION_RAY = dict(num_cpus=2, num_gpus=2, resources={"duet_test_slot": 2}, include_dashboard=False,
                   log_to_driver=False)


def _start_session_ray() -> None:
    """ray.init(**SESSION_RAY), tried twice: on a loaded 2-core machine a local raylet now and then
    fails to register within Ray's own 30 s ("The current node timed out during startup"), and that
    one start failing would error every Ray test of the worker. A second failure is raised."""
    import ray

    try:
        ray.init(**SESSION_RAY)
    except Exception as e:  # only the startup timeout is retried
        if "timed out during startup" not in str(e):
            raise
        warnings.warn(f"local Ray did not start ({e}); starting it again", stacklevel=1)
        ray.shutdown()
        ray.init(**SESSION_RAY)


@pytest.fixture(scope="module")
def session_ray_paused():
    """For a module that joins a Ray cluster of its own (one Ray per process): the session's Ray,
    if an earlier module started it, is shut down for the module and started again afterwards."""
    import ray

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if was_up:
            _start_session_ray()
