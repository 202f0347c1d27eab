"""A bf16 KV cache under float32 activations (``cache.kv_cache_dtype: bfloat16``): the C++ kernels vs
their torch references, on every ISA path this CPU runs.

- rotary_and_cache_write rotates q / k in fp32 exactly as before and rounds k / v to bf16 (round to
  nearest even, as ``.to(torch.bfloat16)``) as it writes them: bit-identical to the reference.
- paged decode and varlen attention widen each bf16 K/V element to fp32 exactly and do the same fp32
  math as with an fp32 cache, so against the reference (which widens the same bf16 values) they
  keep the fp32 kernels' tolerance (KERNEL_FP32), and their output stays float32.
- the bf16 cache is only a storage format: attention over it equals attention over an fp32 cache
  that holds the same (bf16-rounded) values, within KERNEL_FP32.
- mismatches are refused with a message naming the tensor: a float32 cache under bf16 q, k and v
  caches of different dtypes.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from testkit.tolerance import KERNEL_FP32

from test_paged_decode_attention_kernel import CASES as DECODE_CASES, _case as decode_case
from test_varlen_paged_attention_kernel import CASES as VARLEN_CASES, make_case as varlen_case
from test_rotary_and_cache_write_kernel import _case as rotary_case

BF = torch.bfloat16


@pytest.mark.parametrize("B,H,G,D,block_size,lens", DECODE_CASES)
def test_decode_attention_over_a_bf16_cache_matches_ref(isa: str, B, H, G, D, block_size, lens) -> None:
    q, kc, vc, bt, cl = decode_case(B, H, G, D, block_size, lens, torch.int32, seed=sum(lens) + B * D + 1)
    kb, vb = kc.to(BF), vc.to(BF)
    scale = D**-0.5
    out, lse = kernels.paged_decode_attention(q, kb, vb, bt, cl, block_size, scale, return_lse=True)
    ref, ref_lse = kernels.paged_decode_attention_ref(q, kb, vb, bt, cl, block_size, scale, return_lse=True)
    assert out.dtype == torch.float32
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)
    # the same values held in an fp32 cache give the same attention
    KERNEL_FP32.assert_close(out, kernels.paged_decode_attention(q, kb.float(), vb.float(), bt, cl, block_size, scale))


@pytest.mark.parametrize("H,G,D,block_size,ns,ctxs", VARLEN_CASES)
@pytest.mark.parametrize("tree", [False, True])
def test_varlen_attention_over_a_bf16_cache_matches_ref(isa: str, H, G, D, block_size, ns, ctxs, tree) -> None:
    q, kc, vc, bt, cu, cl, bs, scale, parents = varlen_case(H, G, D, block_size, ns, ctxs, seed=sum(ctxs) + D + 1,
                                                            tree=tree)
    kb, vb = kc.to(BF), vc.to(BF)
    out, lse = kernels.varlen_paged_attention(q, kb, vb, bt, cu, cl, bs, scale, tree_parents=parents, return_lse=True)
    ref, ref_lse = kernels.varlen_paged_attention_ref(q, kb, vb, bt, cu, cl, bs, scale, tree_parents=parents,
                                                      return_lse=True)
    assert out.dtype == torch.float32
    KERNEL_FP32.assert_close(out, ref)
    KERNEL_FP32.assert_close(lse, ref_lse)


@pytest.mark.parametrize("T,H,G,D,slots", [(1, 9, 3, 64, [37]), (3, 9, 3, 64, [2, -1, 9]), (2, 4, 2, 40, [0, 63]),
                                           (300, 9, 3, 64, list(range(300)))])
def test_rotary_writes_keys_and_values_rounded_to_bf16(isa: str, T, H, G, D, slots) -> None:
    _, q, k, v, cos, sin, kc, vc, sm = rotary_case(T, H, G, D, 512, slots, torch.int64, seed=T + D + 1)
    a = [q.clone(), k.clone(), v.clone(), cos, sin, kc.to(BF), vc.to(BF), sm]
    b = [q.clone(), k.clone(), v.clone(), cos, sin, kc.to(BF), vc.to(BF), sm]
    kernels.rotary_and_cache_write(*a)
    kernels.rotary_and_cache_write_ref(*b)
    for got, want in zip(a, b, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    written = torch.tensor([s for s in slots if s >= 0])
    rows = torch.tensor([i for i, s in enumerate(slots) if s >= 0])
    assert torch.equal(a[5][written], a[1][rows].to(BF)) and torch.equal(a[6][written], v[rows].to(BF))


def test_mismatched_caches_are_refused_naming_the_tensor(ext) -> None:
    q, kc, vc, bt, cl = decode_case(2, 9, 3, 64, 16, [5, 9], torch.int32, seed=3)
    with pytest.raises(RuntimeError, match="k_cache must be BFloat16"):  # a float32 cache under bf16 q
        kernels.paged_decode_attention(q.to(BF), kc, vc, bt, cl, 16, 0.125)
    with pytest.raises(RuntimeError, match="v_cache must be"):
        kernels.paged_decode_attention(q, kc.to(BF), vc, bt, cl, 16, 0.125)
