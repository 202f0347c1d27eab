"""Rank functions for the shared-memory collective tests (module-level so spawned ranks import them)."""

from __future__ import annotations

import glob
import os
import time

import torch
import torch.distributed as dist

from workers.parallel import comm, shm_comm, shm_segment
from workers.parallel.groups import get_group

from testkit.tolerance import KERNEL_FP32, bf16_ulps

SLOT_ELEMS = shm_segment.SLOT_BYTES // 4  # fp32 elements per slot
# 1 element, one decode all-reduce of SmolLM2 at batch 1 and 8, a size that fills no vector, one
# slot exactly, and two sizes over a slot (several rounds; the last one partial)
SIZES = [1, 576, 8 * 576, 1001, SLOT_ELEMS, SLOT_ELEMS + 17, 2 * (2 * SLOT_ELEMS) + 5]


def _tensor(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def all_reduce_rank(rank: int) -> dict:
    """For each dtype and size: shm == gloo == the sum computed here from every rank's input."""
    g = get_group("tp")
    assert g.shm is not None, "the test must run on shared memory"
    out: dict = {"transport": g.transport, "mismatch": []}
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            inputs = [_tensor(1000 * r + n, n, dtype) for r in range(g.world_size)]
            # the sum in rank order (fp32 accumulation for bf16: what shm does for W > 2)
            acc = inputs[0].to(torch.float32 if g.world_size > 2 else dtype, copy=True)
            for x in inputs[1:]:
                acc += x
            expected = acc.to(dtype)
            via_shm = comm.all_reduce(inputs[rank].clone(), g)
            via_gloo = inputs[rank].clone()
            dist.all_reduce(via_gloo, group=g.group)
            # W = 2: one addition, so gloo rounds the same way; W > 2: gloo adds in another order
            # (and rounds bf16 after each addition), so it agrees to a few units in the last place
            if g.world_size == 2:
                same_as_gloo = torch.equal(via_shm, via_gloo)
            else:
                # bf16: gloo rounds each of its W - 1 partial sums (|s| up to ~8, half an ulp 2^-5 = 0.03):
                # up to ~0.1 apart, 13 bf16 ulps of a value of order 1
                tol = KERNEL_FP32 if dtype == torch.float32 else bf16_ulps(13)
                same_as_gloo = tol.allclose(via_shm.float(), via_gloo.float())
            if not (same_as_gloo and torch.equal(via_shm, expected)):
                out["mismatch"].append((str(dtype), n))
    # a non-contiguous input ([576, 8] transposed) is reduced in place all the same
    base = _tensor(rank, 8 * 576, torch.float32).view(576, 8)
    t = base.t()
    comm.all_reduce(t, g)
    total = sum(_tensor(r, 8 * 576, torch.float32).view(576, 8) for r in range(g.world_size))
    out["non_contiguous_ok"] = torch.equal(base, total)
    return out


def gather_rank(rank: int) -> dict:
    """gather_to_first, all_gather_rows (uneven rows) and ring_shift against what each rank sent."""
    g = get_group("tp")
    w = g.world_size
    res: dict = {}
    big = SLOT_ELEMS + 333  # more than one slot: two rounds
    x = _tensor(rank, big, torch.float32)
    parts = comm.gather_to_first(x.view(1, -1), g)
    res["gather"] = None if parts is None else all(torch.equal(p.view(-1), _tensor(r, big, torch.float32))
                                                   for r, p in enumerate(parts))
    counts = [3 + 2 * r for r in range(w)]
    rows = _tensor(10 + rank, counts[rank] * 5, torch.bfloat16).view(-1, 5)
    got = comm.all_gather_rows(rows, counts, g)
    want = torch.cat([_tensor(10 + r, counts[r] * 5, torch.bfloat16).view(-1, 5) for r in range(w)])
    res["all_gather_rows"] = torch.equal(got, want)
    sizes = [SLOT_ELEMS + 100 * (r + 1) for r in range(w)]  # each rank sends a different size
    mine = _tensor(20 + rank, sizes[rank], torch.float32)
    prev = (rank - 1) % w
    incoming = torch.empty(sizes[prev])
    for req in comm.ring_shift(mine, incoming, max(sizes), g):
        req.wait()
    res["ring_shift"] = torch.equal(incoming, _tensor(20 + prev, sizes[prev], torch.float32))
    return res


def transport_rank(rank: int) -> dict:
    """The transport of each group, and the shm files left by this gang's creators (none: unlinked
    as soon as every rank mapped them)."""
    gang = get_group("gang")
    pids: list = [None] * gang.world_size
    dist.all_gather_object(pids, os.getpid(), group=gang.group)
    left = [f for p in pids for f in glob.glob(os.path.join(shm_segment.SHM_DIR, f"{shm_segment.PREFIX}{p}-*"))]
    return {"tp": get_group("tp").transport, "sp": get_group("sp").transport, "files": left}


def hold_segment(path: str, nonce: int, world: int, rank: int, seconds: float, mapped) -> None:
    """A peer process for the failure tests: map the segment, say so, stay alive ``seconds``, never join."""
    c = shm_comm.ShmCommunicator(path, nonce, rank, world, None, 60.0)
    mapped.set()
    time.sleep(seconds)
    c.close()


def broadcast_rank(rank: int) -> dict:
    """broadcast_object on the gang's control channel (shared memory): small, empty and multi-round."""
    from workers.parallel.comm import broadcast_object

    gang = get_group("gang")
    big = bytes(range(256)) * (shm_segment.SLOT_BYTES // 128 + 3)  # more than two slots
    sent = [{"step": 1, "ids": [1, 2, 3]}, b"", big]
    got = [broadcast_object(obj if rank == 0 else None, 0, gang) for obj in sent]
    return {"transport": gang.transport, "ok": got == sent}


def all_to_all_rank(rank: int) -> dict:
    """Uneven all-to-all (zero-row splits, a stream over two slots) on shm equals gloo's, bf16 rows."""
    g = get_group("ep")
    w = g.world_size
    width = 64
    big = shm_segment.SLOT_BYTES // (2 * width) + 7  # rows: with bf16 rows, over one slot from a single rank
    # counts[i][j]: rows rank i sends rank j
    counts = [[(3 * i + j) % 4 if (i + j) % 3 else 0 for j in range(w)] for i in range(w)]
    counts[0][w - 1] = big
    results = []
    for case in (counts, [[0] * w for _ in range(w)]):
        send, recv = case[rank], [case[i][rank] for i in range(w)]
        x = _tensor(30 + rank, sum(send) * width, torch.bfloat16).view(-1, width)
        via_shm = comm.all_to_all_rows(x, send, recv, g)
        via_gloo = x.new_empty(sum(recv), width)
        dist.all_to_all_single(via_gloo, x, recv, send, group=g.group)
        results.append(g.transport == "shm" and via_shm.shape == via_gloo.shape and torch.equal(via_shm, via_gloo))
    return {"ok": results}
