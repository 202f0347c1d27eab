"""Collective wrappers over a GroupCoordinator: the identity on a one-rank group, so layers call
them unconditionally.

    all_to_all_rows(x, send_counts, recv_counts, g)   uneven all-to-all of rows (MoE dispatch/combine)
    all_gather_rows(x, counts, g)                      rows of every rank, concatenated in rank order
    broadcast_object(obj, src, g)                      a picklable control message (lists, not tensors)

Transport: a group whose ranks share the host has a shared-memory communicator (``g.shm``,
workers/parallel/shm_comm.py); all_reduce, gather_to_first, all_gather_rows, all_to_all_rows and
ring_shift use it for CPU tensors, broadcast_object for its pickled bytes; everything else (and
every CUDA tensor) goes through the torch process group.

gloo implements all_to_all_single with per-rank split sizes (including zero-row splits), so the MoE
dispatch sends each rank exactly the rows it needs. gloo's all_gather needs equal shapes, so
all_gather_rows pads every rank's rows to the largest count and trims after.

Axes: N rows, F features.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from workers.parallel.groups import GroupCoordinator
from workers.parallel.shm_comm import ShmCommunicator


def _shm(x: torch.Tensor, g: GroupCoordinator) -> ShmCommunicator | None:
    """The group's shared-memory communicator when it carries x (a CPU tensor), else None."""
    return g.shm if x.device.type == "cpu" else None


def all_to_all_rows(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int], g: GroupCoordinator
) -> torch.Tensor:
    """x [sum(send_counts), F]: rows [sum(send_counts[:j]), +send_counts[j]) go to group rank j.
    Returns [sum(recv_counts), F]: the rows from group rank 0, then 1, ... ."""
    if g.is_trivial:
        return x
    if (shm := _shm(x, g)) is not None:
        return shm.all_to_all(x, send_counts, recv_counts)
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=g.group)
    return out


def all_gather_rows(x: torch.Tensor, counts: list[int], g: GroupCoordinator) -> torch.Tensor:
    """x [counts[g.rank], F] on each rank -> [sum(counts), F], every rank's rows in rank order."""
    if g.is_trivial:
        return x
    width = max(counts)
    padded = x.new_zeros(width, *x.shape[1:])
    padded[: x.shape[0]] = x
    parts: list[torch.Tensor] | None
    if (shm := _shm(x, g)) is not None:
        parts = shm.all_gather(padded)
    else:
        parts = [torch.empty_like(padded) for _ in range(g.world_size)]
        dist.all_gather(parts, padded, group=g.group)
    assert parts is not None  # not root_only: every rank gets them
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def broadcast_object(obj: Any, src: int, g: GroupCoordinator) -> Any:
    """Group rank ``src``'s obj on every rank (pickled: keep it to lists and small dataclasses)."""
    if g.is_trivial:
        return obj
    if g.shm is not None:
        return pickle.loads(g.shm.broadcast_bytes(pickle.dumps(obj) if g.rank == src else None, src))
    box = [obj]
    dist.broadcast_object_list(box, src=g.ranks[src], group=g.group)
    return box[0]


def ring_shift(x: torch.Tensor, out: torch.Tensor, max_numel: int, g: GroupCoordinator) -> list:
    """One ring step: x goes to the next group rank, ``out`` receives the previous rank's x (sizes
    may differ per rank; ``max_numel`` is the largest any rank sends, the same on every rank).
    Returns the requests to wait on (none on shared memory, where the step completes here)."""
    w, r = g.world_size, g.rank
    if (shm := _shm(x, g)) is not None:
        shm.shift(x, out, (r - 1) % w, max_numel * x.element_size())
        return []
    return [dist.isend(x.contiguous(), g.ranks[(r + 1) % w], group=g.group),
            dist.irecv(out, g.ranks[(r - 1) % w], group=g.group)]


def _host_group(g: GroupCoordinator) -> bool:
    """True for a gloo-only group (the gang's control channel): it cannot carry CUDA tensors."""
    return dist.get_backend(g.group) == "gloo"


def send_tensor(x: torch.Tensor, dst: int, g: GroupCoordinator) -> None:
    """Point to point to group rank ``dst``; a CUDA tensor over a gloo group is staged through host memory."""
    if x.device.type != "cpu" and _host_group(g):
        x = x.cpu()
    dist.send(x.contiguous(), dst=g.ranks[dst], group=g.group)


def recv_tensor(out: torch.Tensor, src: int, g: GroupCoordinator) -> torch.Tensor:
    """Receive into ``out`` from group rank ``src`` (staged through host memory as send_tensor is)."""
    if out.device.type != "cpu" and _host_group(g):
        staged = torch.empty(out.shape, dtype=out.dtype)
        dist.recv(staged, src=g.ranks[src], group=g.group)
        return out.copy_(staged)
    dist.recv(out, src=g.ranks[src], group=g.group)
    return out


# --- tensor parallelism (workers/layers/linear.py, workers/layers/vocab_parallel.py) ---------------

def all_reduce(x: torch.Tensor, g: GroupCoordinator) -> torch.Tensor:
    """Sum of x over the group, in place (x itself is returned)."""
    if g.is_trivial:
        return x
    if (shm := _shm(x, g)) is not None:
        return shm.all_reduce(x)
    dist.all_reduce(x, group=g.group)
    return x


def gather_to_first(x: torch.Tensor, g: GroupCoordinator) -> list[torch.Tensor] | None:
    """Every rank's x (same shape) on group rank 0, in rank order; None on the other ranks."""
    if g.is_trivial:
        return [x]
    x = x.contiguous()
    if (shm := _shm(x, g)) is not None:
        return shm.all_gather(x, root_only=True)
    parts = [torch.empty_like(x) for _ in range(g.world_size)] if g.rank == 0 else None
    dist.gather(x, parts, dst=g.ranks[0], group=g.group)
    return parts
