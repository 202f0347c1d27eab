"""Triton kernels (kernels/triton_ops/) vs the torch references, on CPU in Triton's interpreter.

TRITON_INTERPRET=1 must be set before a kernel module is imported (`@triton.jit` reads it then), so
the `tri` fixture sets it and (re)imports the module. Skipped, with the reason, only when the
optional `triton` package is not installed (`pip install -e '.[triton]'`). The interpreter runs
numpy: shapes are small, but include partial blocks, GQA ratios, empty sequences and trees. bf16
cases check that the kernels compute in fp32 (the interpreter's own bf16 arithmetic is wrong).
Tolerances: fp32 as for the C++ kernels (1e-5); bf16 outputs within one or two bf16 ulps (~8e-3
each): the interpreter converts fp32 -> bf16 by truncation where a GPU rounds to nearest, and an
intermediate rounded to bf16 (as the references do) can flip by an ulp.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

import kernels

from test_varlen_paged_attention_kernel import make_case

from testkit.tolerance import KERNEL_FP32, ELEMENTWISE_FP32, bf16_ulps

pytestmark = pytest.mark.skipif(
    not kernels._triton.triton_available(), reason="the optional triton extra is not installed (pip install -e '.[triton]')"
)


@pytest.fixture(scope="module", autouse=True)
def interpret() -> None:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


def tri(name: str) -> ModuleType:
    """kernels.triton_ops.<name>, built for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module(f"kernels.triton_ops.{name}")
    jitted = [v for v in vars(mod).values() if hasattr(v, "run") and hasattr(v, "fn")]
    if not all(isinstance(v, InterpretedFunction) for v in jitted):  # imported earlier without the interpreter
        mod = importlib.reload(sys.modules[f"kernels.triton_ops.{name}"])
    return mod


@pytest.mark.parametrize(
    "H,G,D,block_size,lens",
    [(9, 3, 64, 16, [1, 0, 17, 100]), (4, 4, 80, 5, [11, 23]), (8, 1, 24, 7, [50, 3]), (14, 2, 64, 16, [40])],
)
@pytest.mark.parametrize("num_splits", [1, 3])  # 3: split-KV partials merged by the Triton merge kernel
def test_paged_decode_attention(H, G, D, block_size, lens, num_splits) -> None:
    q, kc, vc, bt, _, cl, bs, scale, _ = make_case(H, G, D, block_size, [1] * len(lens), [max(n, 1) for n in lens], seed=1)
    cl = torch.tensor(lens, dtype=torch.int32)
    out, lse = tri("paged_decode_attention").paged_decode_attention_triton(
        q, kc, vc, bt, cl, bs, scale, return_lse=True, num_splits=num_splits
    )
    ref, ref_lse = kernels.paged_decode_attention_ref(q, kc, vc, bt, cl, bs, scale, return_lse=True)
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)


@pytest.mark.parametrize(
    "H,G,D,block_size,ns,ctxs,tree",
    [
        (9, 3, 64, 16, [0, 3, 20], [0, 10, 60], False),  # empty sequence, partial blocks, two query blocks
        (9, 3, 64, 16, [0, 3, 20], [0, 10, 60], True),
        (4, 4, 80, 5, [7], [30], True),  # MHA, D = 80 (padded to 128), odd block size
        (8, 1, 24, 7, [5, 2], [5, 40], False),  # MQA
    ],
)
def test_varlen_paged_attention(H, G, D, block_size, ns, ctxs, tree) -> None:
    args = make_case(H, G, D, block_size, ns, ctxs, seed=2, tree=tree)
    out, lse = tri("varlen_paged_attention").varlen_paged_attention_triton(
        *args[:8], tree_parents=args[8], return_lse=True
    )
    ref, ref_lse = kernels.varlen_paged_attention_ref(*args[:8], tree_parents=args[8], return_lse=True)
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)


def test_attention_bf16_computes_in_fp32() -> None:
    q, kc, vc, bt, cu, cl, bs, scale, _ = make_case(9, 3, 64, 16, [4], [40], seed=3)
    qb, kb, vb = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    out = tri("varlen_paged_attention").varlen_paged_attention_triton(qb, kb, vb, bt, cu, cl, bs, scale)
    ref = kernels.varlen_paged_attention_ref(qb.float(), kb.float(), vb.float(), bt, cu, cl, bs, scale)
    assert out.dtype == torch.bfloat16
    bf16_ulps(2).assert_close(out.float(), ref.bfloat16().float())
    dref = kernels.paged_decode_attention_ref(qb.float(), kb.float(), vb.float(), bt.expand(4, -1), cl.expand(4), bs, scale)
    for splits in (1, 2):
        dec = tri("paged_decode_attention").paged_decode_attention_triton(
            qb, kb, vb, bt.expand(4, -1), cl.expand(4), bs, scale, num_splits=splits
        )
        bf16_ulps(2).assert_close(dec.float(), dref.bfloat16().float())


def test_merge_attn_states() -> None:
    g = torch.Generator().manual_seed(4)
    outs = [torch.randn(5, 9, 64, generator=g) for _ in range(3)]
    lses = [torch.randn(5, 9, generator=g) for _ in range(3)]
    outs[0][1, 1] = float("nan")  # weight-0 rows may hold anything
    lses[0][1, 1] = float("-inf")
    for x in lses:
        x[0, 0] = float("-inf")
    out, lse = tri("merge_attn_states").merge_attn_states_triton(outs, lses)
    ref, ref_lse = kernels.merge_attn_states_ref(outs, lses)
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)
    assert torch.equal(out[0, 0], torch.zeros(64))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(with_residual, dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 100, generator=g).to(dtype)  # E = 100: padded to 128
    w = (torch.rand(100, generator=g) + 0.5).to(dtype)
    res = torch.randn(3, 100, generator=g).to(dtype) if with_residual else None
    out, new_res = tri("rms_norm").rms_norm_triton(x, w, 1e-5, res)
    ref, ref_res = kernels.rms_norm_ref(x, w, 1e-5, res)
    # bf16: y is rounded before the weight multiply (2 ulps), and so is the product
    tol = KERNEL_FP32 if dtype is torch.float32 else bf16_ulps(3)
    tol.assert_close(out, ref)
    if with_residual and dtype is torch.float32:
        assert torch.equal(new_res, ref_res)
    elif with_residual:  # the interpreter rounds fp32 -> bf16 toward zero, a GPU to nearest: 1 ulp
        bf16_ulps(1).assert_close(new_res, ref_res)
    else:
        assert new_res is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype) -> None:
    x = (torch.randn(2, 3, 2 * 1100, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)  # 2 column tiles
    out = tri("silu_and_mul").silu_and_mul_triton(x)
    tol = KERNEL_FP32 if dtype is torch.float32 else bf16_ulps(3)  # bf16: silu(g) rounded, then the product
    tol.assert_close(out, kernels.silu_and_mul_ref(x))


def test_rotary_and_cache_write() -> None:
    g = torch.Generator().manual_seed(7)
    T, H, G, D = 5, 9, 3, 64
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, G, D, generator=g), torch.randn(T, G, D, generator=g)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    slots = torch.tensor([3, -1, 7, 0, 19])  # -1: padding, rotated but not written
    kc, vc = torch.zeros(20, G, D), torch.zeros(20, G, D)
    q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
    tri("rotary_and_cache_write").rotary_and_cache_write_triton(q, k, v, cos, sin, kc, vc, slots)
    kernels.rotary_and_cache_write_ref(q2, k2, v, cos, sin, kc2, vc2, slots)
    ELEMENTWISE_FP32.assert_close(q, q2)
    ELEMENTWISE_FP32.assert_close(k, k2)
    ELEMENTWISE_FP32.assert_close(kc, kc2)
    assert torch.equal(vc, vc2)


def test_cpu_tensor_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = tri("silu_and_mul")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        mod.silu_and_mul_triton(torch.randn(1, 4))
