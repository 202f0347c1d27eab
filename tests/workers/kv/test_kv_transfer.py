"""KV transfer between two processes over a real 2-rank gloo group (and, for a killed sender, the
shared-memory ring; its other cases run in one process: test_kv_shm.py). tests/testkit/kv_peer.py
plays the sending worker; the receiver's per-pair loop reads every announced transfer. Transfers arrive
intact and complete in any order; an abandoned transfer is read and discarded without desynchronising
the pair; a corrupted checksum, a wrong block
range, a stalled and a killed sender are each detected without a hang, the pair is dropped and the
next generation works; and a pair's group survives a third worker joining and leaving."""

from __future__ import annotations

import re
import time

import pytest
import torch

from testkit.kv_peer import LAYOUT_ARGS, Peer, kv_of
from workers.kv.transfer import KVLayout, KVReceiver, KVTransferError, block_checksums


@pytest.fixture
def backend():
    """The transport of the peer-process tests (the shm ring's own tests: test_kv_shm.py)."""
    return "gloo"


@pytest.fixture
def receiver():
    r = KVReceiver(KVLayout(*LAYOUT_ARGS), "decode-0", "inc-d", timeout_s=5.0)
    yield r
    r.close()


@pytest.fixture
def peer(backend):
    p = Peer(backend=backend)
    yield p
    p.close()


def test_checksum_detects_single_flip_and_swapped_blocks():
    kv = kv_of(0, 3)
    base = block_checksums(kv)
    flipped = kv.clone()
    flipped[1, 0, 2, 0, 0, 0] += 1e-6
    swapped = kv[:, :, [1, 0, 2]]
    assert (block_checksums(flipped) != base).tolist() == [False, False, True]
    assert (block_checksums(swapped) != base).tolist() == [True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_block_checksum_equals_the_piecewise_stream(dtype):
    """block_checksums hashes a single block in one call (the tiers' case); it must equal the
    stream of the block's L * 2 pieces the wire defines, and each block's checksum in a batch."""
    import xxhash

    from workers.kv.wire import signed64

    kv = kv_of(3, 4).to(dtype)  # [L, 2, 4, bs, G, D]
    batch = block_checksums(kv).tolist()
    for i in range(kv.shape[2]):
        block = kv[:, :, i : i + 1]
        h = xxhash.xxh3_64()
        for piece in block.contiguous().view(torch.uint8).view(-1, block[0, 0, 0].numel() * kv.element_size()).numpy():
            h.update(piece)
        assert block_checksums(block).tolist() == [signed64(h.intdigest())] == [batch[i]]
        assert block_checksums(block.transpose(3, 4).contiguous().transpose(3, 4)).tolist() == [batch[i]]


def test_transfers_arrive_intact_in_any_order(receiver, peer, backend):
    key = receiver.pair_key("prefill-0", "inc-p", backend)
    futures = {tid: receiver.expect(key, tid, first, n) for tid, first, n in (("a", 0, 3), ("b", 2, 1), ("c", 1, 5))}
    receiver.channel(key)
    for seed, (tid, first, n) in enumerate((("c", 1, 5), ("a", 0, 3), ("b", 2, 1))):
        peer.send(key, receiver, tid, first, n, seed)
        assert peer.reply()[0] == "sent"
    for seed, tid in enumerate("cab"):
        got = futures[tid].result(timeout=10)
        assert torch.equal(got.kv, kv_of(seed, got.kv.shape[2]))
    assert receiver.stats.transfers_received == 3 and receiver.stats.failures == 0
    assert receiver.stats.bytes_received > 9 * kv_of(0, 1).nbytes


@pytest.mark.parametrize("mode,first,problem", [("corrupt", 0, "checksum mismatch in block(s) [1]"),
                                                ("ok", 1, "blocks 1..3 sent, 0..2 reserved")])
def test_bad_transfer_rejected_then_next_generation_works(receiver, peer, backend, mode, first, problem):
    key = receiver.pair_key("prefill-0", "inc-p", backend)
    fut = receiver.expect(key, "t1", 0, 3)
    receiver.channel(key)
    peer.send(key, receiver, "t1", first, 3, 7, mode)
    assert peer.reply()[0] == "sent"
    with pytest.raises(KVTransferError, match=re.escape(problem)):
        fut.result(timeout=10)
    new_key = receiver.pair_key("prefill-0", "inc-p", backend)
    assert new_key.generation == key.generation + 1  # dropped: the next request rendezvouses afresh
    fut = receiver.expect(new_key, "t2", 0, 2)
    receiver.channel(new_key)
    peer.send(new_key, receiver, "t2", 0, 2, 8)
    assert peer.reply()[0] == "sent"
    assert torch.equal(fut.result(timeout=10).kv, kv_of(8, 2))


@pytest.mark.parametrize("backend,cases", [("gloo", (True, False)), ("shm", (True,))])
def test_killed_sender_fails_fast_and_stalled_sender_times_out(receiver, backend, cases):
    for kill in cases:
        peer = Peer(backend=backend)
        try:
            key = receiver.pair_key("prefill-0", "inc-p", backend)
            fut = receiver.expect(key, "t", 0, 4)
            peer.send(key, receiver, "t", 0, 4, 1, "stall")
            receiver.channel(key).result(timeout=20)
            assert peer.reply()[0] == "stalled"
            if kill:
                peer.proc.kill()
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="dropped"):  # never hangs: the future fails
                fut.result(timeout=receiver.timeout_s + 5)
            elapsed = time.monotonic() - start
            assert elapsed < (2.0 if kill else receiver.timeout_s + 3)
            assert receiver.pair_key("prefill-0", "inc-p", backend).generation == key.generation + 1
        finally:
            peer.close()


def test_pair_survives_a_third_worker_joining_and_leaving(receiver, peer, backend):
    key = receiver.pair_key("prefill-0", "inc-p", backend)
    fut = receiver.expect(key, "before", 0, 2)
    receiver.channel(key)
    peer.send(key, receiver, "before", 0, 2, 1)
    assert peer.reply()[0] == "sent" and fut.result(timeout=10).kv.shape[2] == 2
    channel = receiver.channel(key).result()

    third = Peer(backend=backend)  # another prefill worker joins, transfers once, and dies
    other = receiver.pair_key("prefill-1", "inc-q", backend)
    fut3 = receiver.expect(other, "third", 0, 1)
    receiver.channel(other)
    third.send(other, receiver, "third", 0, 1, 2)
    assert third.reply()[0] == "sent" and fut3.result(timeout=10).kv.shape[2] == 1
    third.proc.kill()
    third.close()

    assert receiver.pair_key("prefill-0", "inc-p", backend) == key and receiver.channel(key).result() is channel
    fut = receiver.expect(key, "after", 1, 3)
    peer.send(key, receiver, "after", 1, 3, 3)
    assert peer.reply()[0] == "sent"
    assert torch.equal(fut.result(timeout=10).kv, kv_of(3, 3))


def test_abandoned_transfer_is_discarded_and_the_stream_stays_in_sync(receiver, peer, backend):
    key = receiver.pair_key("prefill-0", "inc-p", backend)
    receiver.expect(key, "gone", 0, 2)
    fut = receiver.expect(key, "next", 0, 3)
    receiver.channel(key)
    receiver.cancel("gone")  # its request ended before the KV came
    peer.send(key, receiver, "gone", 0, 2, 1)
    assert peer.reply()[0] == "sent"
    peer.send(key, receiver, "next", 0, 3, 2)
    assert peer.reply()[0] == "sent"
    assert torch.equal(fut.result(timeout=10).kv, kv_of(2, 3))
    assert receiver.stats.transfers_received == 1 and receiver.pair_key("prefill-0", "inc-p", backend) == key
