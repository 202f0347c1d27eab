"""Which torch.distributed backend a gang's world uses, by the device its ranks run on
(workers/parallel/groups.py): CUDA gangs put GPU tensors on NCCL and keep CPU tensors (the control
channel, host-staged KV) on gloo; CPU gangs use gloo alone. The CUDA run itself is gpu-check's
``gang`` section (benchmarks/gpu_check/gang.py); here the choice and the CPU path."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from workers.parallel import comm
from workers.parallel.groups import CUDA_BACKEND, ParallelConfig, gang_backend, get_group
from workers.parallel.launch import spawn_gang


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", CUDA_BACKEND), ("cuda:1", CUDA_BACKEND)])
def test_backend_follows_the_device(device: str, backend: str) -> None:
    assert gang_backend(device) == backend


def control_channel_rank(rank: int) -> dict:
    """What each group of a CPU gang runs on, and a tensor sent over the gang's control channel."""
    import torch

    g = get_group("gang")
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + rank
    if rank == 0:
        got = comm.recv_tensor(torch.empty(2, 3), 1, g)
    else:
        comm.send_tensor(x, 0, g)
        got = None
    return {"world": str(dist.get_backend()), "gang": str(dist.get_backend(g.group)),
            "got": None if got is None else got.tolist()}


def test_cpu_gang_is_gloo_everywhere_and_the_control_channel_carries_tensors() -> None:
    leader, follower = spawn_gang(control_channel_rank, ParallelConfig(tp_size=2), timeout=120)
    assert leader["world"] == follower["world"] == "gloo"
    assert leader["gang"] == "gloo"
    assert leader["got"] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


def test_devices_must_match_the_gang_size() -> None:
    with pytest.raises(ValueError, match="devices: 1 given for a gang of 2 ranks"):
        spawn_gang(control_channel_rank, ParallelConfig(tp_size=2), devices=["cpu"])
