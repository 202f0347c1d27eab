"""The receiver's pool of reusable payload buffers (workers/kv/buffers.py): a buffer is handed out
again only once every tensor made from it is gone, never while a consumer (or a view) still holds
it, and the pool keeps no more than its bound."""

from __future__ import annotations

import torch

from workers.kv.buffers import RecvBuffers


def _addr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone():
    pool = RecvBuffers(max_bytes=1 << 20)
    a = pool.take((4, 8), torch.float32)
    a.fill_(1.0)
    first = _addr(a)
    b = pool.take((4, 8), torch.float32)
    assert _addr(b) != first  # a is still held: never handed out twice
    view = a[1:3]
    del a
    c = pool.take((4, 8), torch.float32)
    assert _addr(c) not in (first, _addr(b)) and torch.equal(view, torch.ones(2, 8))  # a view still holds it
    del view
    d = pool.take((2, 8), torch.bfloat16)  # a smaller payload of another dtype fits the freed buffer
    assert _addr(d) == first and d.shape == (2, 8) and d.dtype == torch.bfloat16
    assert pool.kept_bytes == 3 * 4 * 8 * 4


def pool_arrays(pool: RecvBuffers) -> list[torch.Tensor]:
    return [torch.from_numpy(b.array) for b in pool._buffers]


def test_the_pool_keeps_at_most_its_bound_and_large_payloads_get_their_own_memory():
    pool = RecvBuffers(max_bytes=1000)
    held = [pool.take((100,), torch.float32) for _ in range(3)]  # 400 bytes each, all held
    assert pool.kept_bytes <= 1000
    big = pool.take((300,), torch.float32)  # over the bound: not pooled
    assert big.shape == (300,) and pool.kept_bytes <= 1000
    del held
    again = pool.take((100,), torch.float32)
    assert _addr(again) in {_addr(x) for x in pool_arrays(pool)}
