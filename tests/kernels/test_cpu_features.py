"""kernels/cpu_features.py (torch's cpuinfo probe, which dtype 'auto' reads) against the kernels' own
probe (__builtin_cpu_supports), and the run-time choice of the AVX512-BF16 / VNNI paths, including
the fallback a CPU without them takes (forced here, so an AMX machine tests what CI runs)."""

from __future__ import annotations

import pytest

from kernels.cpu_features import ENV_FAST_BF16, fast_bf16, features
from testkit.kernel_paths import available_paths, on_path


def test_the_two_probes_agree(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FAST_BF16, raising=False)  # the suite sets 0 (tests/conftest.py): ask the CPU
    f = features()
    assert ext.cpu_has("avx512_bf16") == (f.avx512_bf16 and ext.best_isa() == "avx512")
    assert ext.cpu_has("avx512_vnni") == (f.avx512_vnni and ext.best_isa() == "avx512")
    assert (ext.best_isa() == "avx512") == f.avx512
    assert fast_bf16() == (f.avx512_bf16 or f.amx)


def test_each_path_takes_the_code_its_cpu_would(ext) -> None:
    seen = {}
    for path in available_paths(ext):
        with on_path(ext, path):
            seen[path] = (ext.gemv_bf16_native(), ext.quant_path())
    native = seen.get("avx512")
    if native is not None:
        assert native == (ext.cpu_has("avx512_bf16"), "avx512_vnni" if ext.cpu_has("avx512_vnni") else "avx2")
        assert seen["avx512-nodots"] == (False, "avx2")  # an AVX-512 CPU without BF16 / VNNI
    if "avx2" in seen:
        assert seen["avx2"] == (False, "avx2")
    assert seen["scalar"] == (False, "scalar")
    assert ext.dot_extensions()  # restored by on_path
