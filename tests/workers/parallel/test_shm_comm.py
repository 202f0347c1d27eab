"""Shared-memory collectives (workers/parallel/shm_comm.py) between real processes.

Equivalence: in a 2-rank gang (and a 3-rank one, which sums in another order than gloo) every
shared-memory all-reduce equals gloo's all-reduce of the same inputs and the sum computed locally,
fp32 and bf16, over sizes from 1 element to several slots (partial last round); gather, uneven
all-gather, a ring step with per-rank sizes over a slot, the gang's object broadcast (small,
empty, several slots) and uneven all-to-all (zero-row splits, over a slot; equal to gloo's)
return exactly what was sent.
Selection: same-host CPU groups get shared memory unless ParallelConfig.comm is gloo; a bad comm is a
ConfigError. Cleanup and failure: no segment file outlives group creation, a dead creator's file is
swept, a peer that dies mid-collective or never arrives fails the collective with CollectiveError
(not a hang), after which the communicator refuses further calls."""

from __future__ import annotations

import os
import time

import pytest
import torch

from testkit.shm_cases import all_reduce_rank, all_to_all_rank, broadcast_rank, gather_rank, hold_segment, transport_rank
from workers.errors import ConfigError
from workers.parallel import shm_comm, shm_segment
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import helper_process, process_context, spawn_gang

pytestmark = pytest.mark.skipif(not shm_segment.supported(), reason="shared-memory collectives need x86-64 Linux")


@pytest.mark.parametrize("tp", [2, 3])
def test_all_reduce_equals_gloo(tp):
    for res in spawn_gang(all_reduce_rank, ParallelConfig(tp_size=tp), comm="shm"):
        assert res["transport"] == "shm"
        assert res["mismatch"] == []
        assert res["non_contiguous_ok"]


def test_gather_all_gather_and_ring_shift():
    r0, r1 = spawn_gang(gather_rank, ParallelConfig(tp_size=2), comm="shm")
    assert r0["gather"] is True and r1["gather"] is None
    assert r0["all_gather_rows"] and r1["all_gather_rows"]
    assert r0["ring_shift"] and r1["ring_shift"]


@pytest.mark.parametrize("ep", [2, 3])
def test_all_to_all_equals_gloo(ep):
    for res in spawn_gang(all_to_all_rank, ParallelConfig(ep_size=ep), comm="shm"):
        assert res["ok"] == [True, True]


def test_broadcast_object_on_the_gang_channel():
    for res in spawn_gang(broadcast_rank, ParallelConfig(tp_size=2), comm="shm"):
        assert res == {"transport": "shm", "ok": True}


def test_selection_and_no_leaked_files():
    for res in spawn_gang(transport_rank, ParallelConfig(sp_size=2, tp_size=2)):  # default: auto
        assert (res["tp"], res["sp"]) == ("shm", "shm")
        assert res["files"] == []
    for res in spawn_gang(transport_rank, ParallelConfig(tp_size=2), comm="gloo"):
        assert (res["tp"], res["sp"]) == ("gloo", "none")


def test_bad_comm_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="comm='tcp': must be one of auto, shm, gloo"):
        ParallelConfig(tp_size=2, comm="tcp")


def test_stale_segment_of_a_dead_creator_is_swept():
    p = helper_process(time.sleep, (0,))
    p.start()
    p.join()  # a pid that no longer exists
    path = os.path.join(shm_segment.SHM_DIR, f"{shm_segment.PREFIX}{p.pid}-deadbeef")
    open(path, "wb").close()
    try:
        assert shm_segment.sweep_stale() >= 1
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _pair(seconds: float, timeout_s: float):
    """This process as rank 0 and a peer process (rank 1, started as a gang rank is) that maps the
    segment but never joins."""
    path, nonce = shm_segment.create_segment(2)
    mapped = process_context().Event()
    peer = helper_process(hold_segment, (path, nonce, 2, 1, seconds, mapped))
    peer.start()
    try:
        assert mapped.wait(120), "the peer did not map the segment"
        comm = shm_comm.ShmCommunicator(path, nonce, 0, 2, [os.getpid(), peer.pid], timeout_s, "test")
    finally:
        os.unlink(path)
    return comm, peer


def test_dead_peer_fails_fast_and_breaks_the_group():
    comm, peer = _pair(seconds=0.5, timeout_s=60.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(shm_comm.CollectiveError, match="died"):
            comm.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 15.0  # found by the liveness check, long before the 60 s timeout
        with pytest.raises(shm_comm.CollectiveError, match="unusable"):
            comm.all_reduce(torch.ones(4))
    finally:
        comm.close()
        peer.join(timeout=10)


def test_stuck_peer_times_out():
    comm, peer = _pair(seconds=30.0, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(shm_comm.CollectiveError, match="did not reach"):
            comm.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 10.0
    finally:
        comm.close()
        peer.kill()
        peer.join(timeout=10)
