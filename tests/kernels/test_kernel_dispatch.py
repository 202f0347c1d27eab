"""The wrappers' choice between C++ kernels and torch references, and its bookkeeping."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import _build

REPO = Path(__file__).resolve().parents[2]


def _all_ops_once() -> None:
    x = torch.randn(2, 64)
    kernels.rms_norm(x, torch.ones(64), 1e-5, x)
    kernels.silu_and_mul(x)
    kernels.linear(x, torch.randn(8, 64))
    bt, cl = torch.tensor([[0]]), torch.tensor([3])
    kernels.paged_decode_attention(torch.randn(1, 4, 16), torch.randn(16, 2, 16), torch.randn(16, 2, 16), bt, cl, 16, 0.25)
    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    kernels.rotary_and_cache_write(q, k, v, torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), torch.tensor([1]))
    kernels.varlen_paged_attention(torch.randn(2, 4, 16), torch.randn(16, 2, 16), torch.randn(16, 2, 16), bt, torch.tensor([0, 2]), cl, 16, 0.25)
    kernels.merge_attn_states([torch.randn(1, 2, 8)] * 2, [torch.randn(1, 2)] * 2)


OPS = ("rms_norm", "silu_and_mul", "linear", "paged_decode_attention", "rotary_and_cache_write", "varlen_paged_attention", "merge_attn_states")


@pytest.fixture
def spy_ext(ext, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records which extension ops the wrappers call (the ops still run)."""
    calls: list[str] = []
    for name in OPS:
        fn = getattr(ext, name)
        monkeypatch.setattr(ext, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    return calls


def test_cpu_kernels_available_here() -> None:
    assert kernels.cpu_kernels_available(), _build.unavailable_reason()


def test_wrappers_use_kernels_by_default(spy_ext: list[str]) -> None:
    kernels.reset_fallback_counts()
    _all_ops_once()
    assert spy_ext == list(OPS)
    assert kernels.fallback_counts() == {}


def test_toggle_forces_ref_without_counting(spy_ext: list[str]) -> None:
    kernels.reset_fallback_counts()
    old = kernels.set_cpu_kernels_enabled(False)
    try:
        assert not kernels.cpu_kernels_enabled()
        _all_ops_once()
    finally:
        kernels.set_cpu_kernels_enabled(old)
    assert spy_ext == []
    assert kernels.fallback_counts() == {}  # deliberate, not a fallback


def test_disabled_in_a_fresh_process_never_loads_the_extension() -> None:
    code = (
        "import torch, kernels\n"
        "from kernels import _build\n"
        "kernels.set_cpu_kernels_enabled(False)\n"
        "x = torch.randn(1, 64)\n"
        "out, _ = kernels.rms_norm(x, torch.ones(64), 1e-5)\n"
        "assert torch.equal(out, kernels.rms_norm_ref(x, torch.ones(64), 1e-5)[0])\n"  # disabled: the wrapper is the ref

        "assert not kernels.cpu_kernels_enabled()\n"
        "assert _build._ext is None, 'the extension must not even be loaded'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_build_failure_warns_once_and_counts(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_build, "_ext", None)
    monkeypatch.setattr(_build, "_error", "RuntimeError: simulated compiler failure")
    monkeypatch.setattr(_build, "_enabled", True)
    monkeypatch.setattr(_build, "_warned", set())
    kernels.reset_fallback_counts()
    with caplog.at_level(logging.WARNING, logger="kernels._build"):
        x = torch.randn(1, 32)
        for _ in range(3):
            out = kernels.silu_and_mul(x)
        assert torch.equal(out, kernels.silu_and_mul_ref(x))  # the fallback is the reference itself
    assert not kernels.cpu_kernels_available()
    assert kernels.fallback_counts() == {"silu_and_mul:cpu kernels unavailable": 3}
    assert len([r for r in caplog.records if "silu_and_mul" in r.getMessage()]) == 1


def test_unsupported_dtype_counts_fallback(ext) -> None:
    # float32 and bfloat16 have CPU kernels; float16 runs the references and counts.
    kernels.reset_fallback_counts()
    x = torch.randn(2, 16, dtype=torch.float16)
    out, _ = kernels.rms_norm(x, torch.ones(16, dtype=torch.float16), 1e-5)
    assert out.dtype == torch.float16
    kernels.linear(x, torch.randn(4, 16, dtype=torch.float16))
    assert kernels.fallback_counts() == {
        "rms_norm:no kernel for cpu/torch.float16": 1,
        "linear:no kernel for x torch.float16 with w torch.float16": 1,
    }


def test_failed_build_in_subprocess_falls_back(tmp_path: Path) -> None:
    # A real failed build (a compiler that does not exist) must warn and fall back, not crash.
    code = (
        "import logging, torch, kernels\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "x = torch.randn(1, 8)\n"
        "kernels.silu_and_mul(x)\n"
        "assert not kernels.cpu_kernels_available()\n"
        "print(kernels.fallback_counts())\n"
    )
    env = dict(os.environ, CXX="/nonexistent/c++", DUET_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "{'silu_and_mul:cpu kernels unavailable': 1}" in res.stdout
    assert "CPU kernels are unavailable" in res.stderr


class FakeCudaTensor:
    """Just enough of a CUDA tensor for the wrappers' dispatch (there is no GPU here)."""

    is_cpu, is_cuda, dtype, device = False, True, torch.float32, torch.device("cuda")


# op, module, wrapper arguments (first is the "CUDA tensor"), the module's reference name
CUDA_OPS = [
    ("rms_norm", "kernels.rms_norm", lambda x: (x, None, 1e-5), "rms_norm_ref"),
    ("silu_and_mul", "kernels.silu_and_mul", lambda x: (x,), "silu_and_mul_ref"),
    ("paged_decode_attention", "kernels.paged_decode_attention", lambda x: (x, None, None, None, None, 16, 1.0), "paged_decode_attention_ref"),
    ("rotary_and_cache_write", "kernels.rotary_and_cache_write", lambda x: (x,) + (None,) * 7, "rotary_and_cache_write_ref"),
    ("varlen_paged_attention", "kernels.varlen_paged_attention", lambda x: (x, None, None, None, None, None, 16, 1.0), "varlen_paged_attention_ref"),
    ("merge_attn_states", "kernels.merge_attn_states", lambda x: ([x], [x]), "merge_attn_states_ref"),
]


@pytest.mark.parametrize("op,module,args,ref_name", CUDA_OPS)
@pytest.mark.parametrize("has_triton", [True, False])
def test_cuda_dispatch(monkeypatch: pytest.MonkeyPatch, op, module, args, ref_name, has_triton) -> None:
    """CUDA tensors go to the op's Triton kernel; without triton, to the reference, counted."""
    import importlib
    import types

    from kernels import _triton

    mod = importlib.import_module(module)
    calls: list[str] = []
    monkeypatch.setattr(_triton, "triton_available", lambda: has_triton)
    fake_triton = types.SimpleNamespace(**{f"{op}_triton": lambda *a, **k: calls.append("triton") or ("triton", None)})
    monkeypatch.setattr(_triton, "ops", lambda name: fake_triton if name == op else pytest.fail(name))
    monkeypatch.setattr(mod, ref_name, lambda *a, **k: calls.append("ref") or ("ref", None))
    kernels.reset_fallback_counts()
    getattr(kernels, op)(*args(FakeCudaTensor()))
    assert calls == (["triton"] if has_triton else ["ref"])
    assert kernels.fallback_counts() == ({} if has_triton else {f"{op}:triton unavailable": 1})
