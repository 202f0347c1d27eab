"""Process groups of a gang of ranks, created once per process: expert (ep), sequence (sp) and
tensor (tp) parallel groups over one torch.distributed world.

Terms. A *gang* is the set of ranks that together act as one worker (one engine, one endpoint).
Its world of ``ep_size * sp_size * tp_size`` ranks is laid out as a mesh [ep, sp, tp] with tp
innermost: rank = (i_ep * sp_size + i_sp) * tp_size + i_tp. The group of an axis holds the ranks
that differ only along that axis, e.g. with ep=2, tp=2 the tp groups are {0, 1}, {2, 3} and the ep
groups {0, 2}, {1, 3}. An axis of size 1 gets a trivial one-rank group (no process group, every
collective is the identity), so single-rank code runs the same layers unchanged.

Worked example (two processes, EP=2 over gloo)::

    init_parallel_groups(ParallelConfig(ep_size=2), rank=r, init_method="tcp://127.0.0.1:29500")
    ep = get_group("ep")        # GroupCoordinator(rank=r, world_size=2, ...)
    ...
    destroy_parallel_groups()

Backends follow the rank's device (``gang_backend``): a gang on CUDA joins its world with
``cpu:gloo,cuda:nccl``, so the forward's collectives on GPU tensors run over NCCL and any CPU
tensor still goes over gloo; a CPU gang uses gloo alone. The gang's control channel (the leader's
per-step broadcast and the KV gather/scatter to the leader) is always a gloo group: it carries
pickled messages and host-staged KV, and must not queue behind the forward's NCCL kernels. Every
collective of these groups fails after ``timeout`` instead of hanging when a peer dies (gloo
notices a closed connection at once; the timeout covers a peer that is alive but stuck).

Same-host groups on CPU: when every rank of an ep/sp/tp group runs on one host, the group also gets
a shared-memory communicator (``GroupCoordinator.shm``, workers/parallel/shm_comm.py) and the
collective wrappers in comm.py use it for CPU tensors: no TCP round trip per all-reduce. The choice
is made once, at creation, by exchanging host ids over the group; the gang's control channel gets
one too (its broadcast runs once per step). ``ParallelConfig.comm`` overrides it:
``auto`` (default) as above, ``shm`` (refuse to start unless every group gets shared memory) or
``gloo`` (the process group's own collectives only, for comparison).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.config import COMM_MODES, PARALLEL_AXES, ParallelConfig  # noqa: F401 - re-exported
from workers.errors import ConfigError
from workers.parallel.shm_comm import ShmCommunicator, open_group

logger = logging.getLogger(__name__)

AXES = PARALLEL_AXES  # mesh order, outermost first


@dataclass(frozen=True)
class GroupCoordinator:
    """One axis group as seen by this rank: its rank within the group, the group size, the global
    ranks in group order, and the torch process group (None for a one-rank group)."""

    name: str
    rank: int
    world_size: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    shm: ShmCommunicator | None = None  # same-host shared-memory collectives (CPU tensors)

    @property
    def is_trivial(self) -> bool:
        return self.world_size == 1

    @property
    def transport(self) -> str:
        """What carries this group's CPU collectives: 'shm', the backend's name, or 'none'."""
        if self.is_trivial:
            return "none"
        return "shm" if self.shm is not None else dist.get_backend(self.group)


_TRIVIAL = {a: GroupCoordinator(a, 0, 1, (0,), None) for a in (*AXES, "gang")}
_groups: dict[str, GroupCoordinator] = {}


CUDA_BACKEND = "cpu:gloo,cuda:nccl"  # one world, each collective dispatched by its tensors' device


def gang_backend(device: str) -> str:
    """The torch.distributed backend of a gang whose ranks run on ``device`` ('cpu', 'cuda', 'cuda:N')."""
    return CUDA_BACKEND if device.split(":")[0] == "cuda" else "gloo"


def init_parallel_groups(
    config: ParallelConfig,
    rank: int,
    init_method: str,
    backend: str | None = None,
    timeout: timedelta = timedelta(seconds=30),
    device: str = "cpu",
    control_timeout: timedelta = timedelta(days=1),
) -> None:
    """Join the gang's world (rank ``rank`` of ``config.world_size``) and create every axis group.
    Collective: every rank of the gang calls it with the same config and init_method. ``device``:
    where this rank's engine runs (resolved: 'cpu' or 'cuda[:N]'); on CUDA the rank's GPU becomes the
    current device first (Ray's CUDA_VISIBLE_DEVICES makes it index 0 unless an index is given),
    as NCCL requires. ``backend`` overrides ``gang_backend(device)``."""
    if _groups:
        raise RuntimeError("parallel groups are already initialised in this process")
    mode = config.comm
    world = config.world_size
    if not 0 <= rank < world:
        raise ConfigError(f"rank={rank}: must be in [0, {world}) for {config}")
    if device.split(":")[0] == "cuda":
        torch.cuda.set_device(torch.device(device).index or 0)
    dist.init_process_group(backend or gang_backend(device), init_method=init_method, rank=rank, world_size=world,
                            timeout=timeout)
    mesh = torch.arange(world).view(config.ep_size, config.sp_size, config.tp_size)
    for dim, axis in enumerate(AXES):
        size = mesh.shape[dim]
        # Every way of fixing the other two coordinates gives one group along this axis.
        lines = mesh.movedim(dim, -1).reshape(-1, size).tolist()  # [world / size, size]
        for line in lines:
            # new_group is collective over the whole world: every rank creates every group.
            pg = dist.new_group(line, timeout=timeout) if size > 1 else None
            if rank in line:
                _groups[axis] = GroupCoordinator(axis, line.index(rank), size, tuple(line), pg)
    # The gang's control channel (the leader's per-step broadcast): the whole world, with a long
    # timeout, because followers wait on it while the leader idles between requests. A dead peer
    # still fails it at once (gloo sees the closed connection).
    pg = dist.new_group(list(range(world)), timeout=control_timeout, backend="gloo") if world > 1 else None
    _groups["gang"] = GroupCoordinator("gang", rank, world, tuple(range(world)), pg)
    if mode != "gloo" and dist.get_backend() == "gloo":
        _attach_shm(mode, {**{a: timeout for a in AXES}, "gang": control_timeout})
    elif mode != "gloo":  # on CUDA the axes' tensors go over NCCL; only the control channel is on the host
        _attach_shm(mode, {"gang": control_timeout})
    logger.info("rank %d/%d joined groups: %s", rank, world,
                {a: (g.ranks, g.transport) for a, g in _groups.items()})


def _attach_shm(mode: str, timeouts: dict[str, timedelta]) -> None:
    """Give each non-trivial group of this rank (the axes', and the gang's control channel) a
    shared-memory communicator when its ranks share the host (collective over each group; the
    groups of one axis are disjoint)."""
    for axis, timeout in timeouts.items():
        g = _groups[axis]
        if g.is_trivial:
            continue
        shm = open_group(g.group, g.rank, g.world_size, f"{axis}{list(g.ranks)}", timeout.total_seconds())
        if shm is None and mode == "shm":
            raise ConfigError(f"comm='shm': the {axis} group {list(g.ranks)} cannot use shared memory "
                              "(see the warning above); use comm 'auto'")
        _groups[axis] = GroupCoordinator(axis, g.rank, g.world_size, g.ranks, g.group, shm)


def get_group(axis: str) -> GroupCoordinator:
    """This rank's group along ``axis`` ('ep', 'sp' or 'tp', or 'gang': the whole world, for the
    leader's control messages); a trivial group if none was created."""
    if axis not in _TRIVIAL:
        raise ValueError(f"unknown parallel axis {axis!r}; known: {tuple(_TRIVIAL)}")
    return _groups.get(axis, _TRIVIAL[axis])


def groups_initialised() -> bool:
    return bool(_groups)


def destroy_parallel_groups() -> None:
    """Leave the world (idempotent); after this every axis is trivial again."""
    for g in _groups.values():
        if g.shm is not None:
            g.shm.close()
    _groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
