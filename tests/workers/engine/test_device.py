"""Device and dtype resolution (workers/engine/device.py): every branch, without a GPU."""

from __future__ import annotations

import pytest

from workers.engine.device import check_gpu_count, resolve_device, resolve_dtype
from workers.errors import ConfigError


@pytest.mark.parametrize("req,gpus,cuda,want", [
    ("auto", 1, True, "cuda"), ("auto", 0.5, True, "cuda"), ("auto", 0, True, "cpu"), ("auto", 0, False, "cpu"),
    ("cpu", 1, True, "cpu"), ("cpu", 0, False, "cpu"), ("cpu", 2, False, "cpu"),
    ("cuda", 1, True, "cuda"), ("cuda", 0, True, "cuda"), ("cuda:1", 2, True, "cuda:1"),
])
def test_resolve_device(req: str, gpus: float, cuda: bool, want: str) -> None:
    assert resolve_device(req, gpus=gpus, cuda_available=cuda) == want


@pytest.mark.parametrize("req,gpus,cuda,visible,match", [
    ("cuda", 1, False, None, r"pools\[0\].engine.device='cuda': this node has no CUDA"),
    ("auto", 1, False, None, r"pools\[0\].engine.device=auto: the pool reserves 1 GPU\(s\) per rank but this node has no CUDA"),
    ("cuda", 0, True, 0, "no GPU is visible"),
    ("auto", 1, True, 0, "no GPU is visible"),
    ("gpu", 0, True, None, "must be one of auto, cpu, cuda"),
    ("cuda:x", 0, True, None, "must be one of auto, cpu, cuda"),
    ("cpu:0", 0, True, None, "must be one of auto, cpu, cuda"),
    ("auto", -1, True, None, "cannot hold -1 GPUs"),
])
def test_resolve_device_refusals(req, gpus, cuda, visible, match) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_device(req, gpus=gpus, cuda_available=cuda, visible_gpus=visible, key="pools[0].engine.device")


@pytest.mark.parametrize("req,device,ckpt,want", [
    ("auto", "cuda", "bfloat16", "bfloat16"), ("auto", "cuda:1", "float16", "float16"),
    ("auto", "cuda", None, "bfloat16"), ("auto", "cuda", "float8_e4m3fn", "bfloat16"),
    ("auto", "cpu", "bfloat16", "float32"), ("float16", "cpu", "bfloat16", "float16"),
    ("bfloat16", "cuda", "float32", "bfloat16"),
])
def test_resolve_dtype(req, device, ckpt, want) -> None:
    assert resolve_dtype(req, device, ckpt) == want


@pytest.mark.parametrize("req,device,ckpt,quant,want", [
    ("auto", "cpu", "float32", "none", "bfloat16"), ("auto", "cpu", "bfloat16", "none", "bfloat16"),
    ("auto", "cpu", None, "none", "bfloat16"), ("auto", "cpu", "bfloat16", "int8", "float32"),
    ("auto", "cpu", None, "q4", "float32"), ("float32", "cpu", "bfloat16", "none", "float32"),
    ("auto", "cuda", "float32", "none", "float32"),
])
def test_resolve_dtype_on_a_cpu_with_native_bf16(req, device, ckpt, quant, want) -> None:
    # cpu_bf16: the CPU has AVX512-BF16 or AMX (kernels/cpu_features.fast_bf16)
    assert resolve_dtype(req, device, ckpt, quantization=quant, cpu_bf16=True) == want


def test_fast_bf16_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.cpu_features import ENV_FAST_BF16, fast_bf16, features

    monkeypatch.setenv(ENV_FAST_BF16, "1")
    assert fast_bf16()
    monkeypatch.setenv(ENV_FAST_BF16, "0")
    assert not fast_bf16()
    monkeypatch.delenv(ENV_FAST_BF16)
    assert fast_bf16() == (features().avx512_bf16 or features().amx)
    monkeypatch.setenv(ENV_FAST_BF16, "yes")
    with pytest.raises(ValueError, match="DUET_CPU_BF16='yes': must be 0 or 1"):
        fast_bf16()


def test_resolve_dtype_refuses_unknown() -> None:
    with pytest.raises(ConfigError, match="model.dtype='half': must be auto or one of"):
        resolve_dtype("half", "cuda", None, key="model.dtype")


def test_gpu_count() -> None:
    check_gpu_count(2, 2)
    check_gpu_count(0.5, 1)
    with pytest.raises(ConfigError, match=r"pools\[1\].gpus_per_rank=4: this node shows 2 GPU"):
        check_gpu_count(4, 2, key="pools[1].gpus_per_rank")


def test_resolve_engine_config() -> None:
    from workers.config import EngineConfig
    from workers.engine.device import resolve_engine_config

    gpu = dict(gpus=1, cuda_available=True, visible_gpus=1)
    cfg = resolve_engine_config(EngineConfig(), **gpu, model_dtype="bfloat16")
    assert (cfg.device, cfg.dtype, cfg.resolved) == ("cuda", "bfloat16", True)
    cpu = resolve_engine_config(EngineConfig(), gpus=0, cuda_available=False, visible_gpus=0, model_dtype="bfloat16")
    assert (cpu.device, cpu.dtype) == ("cpu", "float32")
    cpu = resolve_engine_config(EngineConfig(), gpus=0, cuda_available=False, visible_gpus=0, model_dtype="float32",
                                cpu_bf16=True)
    assert (cpu.device, cpu.dtype) == ("cpu", "bfloat16")
    assert resolve_engine_config(EngineConfig(quantization="q4"), **gpu, model_dtype="bfloat16").dtype == "float32"
    with pytest.raises(ConfigError, match="cuda_graphs=true needs device cuda \\(got device='cpu'\\)"):
        resolve_engine_config(EngineConfig(cuda_graphs=True), gpus=0, cuda_available=False, visible_gpus=0,
                              model_dtype=None)


def test_engine_refuses_cuda_without_cuda(smollm2_path) -> None:
    """device cuda on this CPU-only machine: refused at engine start, naming the key."""
    import torch

    from workers.config import EngineConfig
    from workers.build import build_engine

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device='cuda': this node has no CUDA device"):
        build_engine(EngineConfig(model=str(smollm2_path), device="cuda"))
