"""The shared-memory KV transport and the wire format, in one process (sender and receiver on
their pairs' own threads; the killed-peer case runs across processes in test_kv_transfer.py):
transfers larger than the ring arrive intact, a peer serving another model is refused at the
header, the per-block checksum catches values reordered inside a block, a closed receiver fails a
blocked sender at once, an offer from another host is refused naming the setting, ``auto`` picks
shm only for same-host CPU peers, and no /dev/shm file is left behind."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest
import torch

from testkit.kv_peer import LAYOUT_ARGS, kv_of
from workers.kv import shm as kv_shm
from workers.kv.transfer import KVLayout, KVReceiver, KVSender, KVTransferError, block_checksums, choose_backend
from workers.engine.runner import kv_fingerprint

LAYOUT = KVLayout(*LAYOUT_ARGS)


def _our_segments() -> list[str]:
    return glob.glob(f"/dev/shm/duet-shm-{os.getpid()}-kv-*")


@pytest.fixture
def pair():
    """(receiver, sender) with fingerprint 7 on both sides; both closed after the test."""
    receiver = KVReceiver(LAYOUT, "decode-0", "inc-d", timeout_s=5.0, fingerprint=7)
    sender = KVSender(LAYOUT, "shm", timeout_s=5.0, fingerprint=7)
    yield receiver, sender
    receiver.close()
    for key in list(sender._channels.values()):
        sender.drop(key.key)
    assert not _our_segments(), "a /dev/shm segment outlived its pair"


def _channel(receiver, sender):
    key = receiver.pair_key("prefill-0", "inc-p", "shm")
    receiving = receiver.channel(key)
    channel = sender.channel(key, receiver.address).result(timeout=10)
    receiving.result(timeout=10)  # the receiver's side is up too (it unlinks the file first)
    return key, channel


def test_transfers_larger_than_the_ring_arrive_intact_and_leave_no_file(pair, monkeypatch):
    monkeypatch.setattr(kv_shm, "DEFAULT_CAPACITY", 64 << 10)  # 64 KiB ring, ~100 KiB payloads
    monkeypatch.setattr(kv_shm, "CHUNK", 16 << 10)
    receiver, sender = pair
    key = receiver.pair_key("prefill-0", "inc-p", "shm")
    futures = [receiver.expect(key, f"t{i}", i, 50) for i in range(3)]
    key, channel = _channel(receiver, sender)
    assert not _our_segments()  # unlinked as soon as the sender mapped it
    for i in range(3):
        sender.send(channel, f"t{i}", i, kv_of(i, 50))
    for i, fut in enumerate(futures):
        got = fut.result(timeout=10)
        assert got.first_block == i and torch.equal(got.kv, kv_of(i, 50))
    assert receiver.stats.transfers_received == 3 and receiver.stats.failures == 0
    assert sender.stats.bytes_sent == receiver.stats.bytes_received > 3 * kv_of(0, 50).nbytes


@pytest.mark.parametrize("pending_backend", ["shm", None])  # None: the receiver's own (gloo)
def test_a_rendezvous_waiting_for_its_peer_holds_up_no_other_pair_nor_close(pending_backend):
    """A pair whose sender never comes waits on its own store client: another pair meanwhile
    builds and transfers, and close() returns, both while that rendezvous still waits (on the shared
    client both would have waited for it to time out)."""
    receiver = KVReceiver(LAYOUT, "decode-0", "inc-d", timeout_s=6.0, fingerprint=7)
    sender = KVSender(LAYOUT, "shm", timeout_s=6.0, fingerprint=7)
    try:
        pending = receiver.channel(receiver.pair_key("prefill-9", "gone", pending_backend))
        time.sleep(0.5)  # its rendezvous is waiting by now
        key = receiver.pair_key("prefill-0", "inc-p", "shm")
        fut = receiver.expect(key, "t", 0, 2)
        key, channel = _channel(receiver, sender)
        sender.send(channel, "t", 0, kv_of(0, 2))
        assert torch.equal(fut.result(timeout=20).kv, kv_of(0, 2))
        assert not pending.done()
        sender.drop(key)
        receiver.close()
        assert not pending.done()  # close() did not wait for it
        with pytest.raises(KVTransferError, match="rendezvous failed"):
            pending.result(timeout=30)  # it times out on its own (and unlinks its segment)
    finally:
        receiver.close()


def test_a_peer_with_another_model_is_refused_at_the_header(pair):
    receiver, _ = pair
    other = KVSender(LAYOUT, "shm", timeout_s=5.0, fingerprint=8)
    key = receiver.pair_key("prefill-0", "inc-p", "shm")
    fut = receiver.expect(key, "t", 0, 2)
    key, channel = _channel(receiver, other)
    other.send(channel, "t", 0, kv_of(0, 2))
    with pytest.raises(KVTransferError, match="model fingerprint mismatch.*different model"):
        fut.result(timeout=10)
    assert receiver.pair_key("prefill-0", "inc-p", "shm").generation == key.generation + 1  # pair dropped
    other.drop(key)


def test_fingerprint_tells_models_apart():
    from workers.models.config import ModelSpec

    fields = {f: 1 for f in ModelSpec.__dataclass_fields__ if f not in ("rope_scaling", "eos_token_ids")}
    spec = ModelSpec(**{**fields, "model_type": "llama", "rope_scaling": None, "eos_token_ids": (2,)})
    base = kv_fingerprint(spec, torch.float32)
    assert base == kv_fingerprint(spec, "float32")  # stable, name or dtype
    assert base != kv_fingerprint(spec, torch.bfloat16)
    assert base != kv_fingerprint(spec, torch.float32, "int8")
    from dataclasses import replace

    assert base != kv_fingerprint(replace(spec, hidden_size=2), torch.float32)


def test_checksum_catches_values_reordered_inside_a_block():
    kv = kv_of(0, 2)
    reordered = kv.clone()
    a, b = reordered[0, 1, 1, 0, 0, 0].item(), reordered[1, 0, 1, 3, 1, 7].item()
    reordered[0, 1, 1, 0, 0, 0], reordered[1, 0, 1, 3, 1, 7] = b, a  # same multiset of values: a sum misses it
    assert (block_checksums(reordered) != block_checksums(kv)).tolist() == [False, True]


def test_a_closed_receiver_fails_a_blocked_sender_at_once(pair, monkeypatch):
    monkeypatch.setattr(kv_shm, "DEFAULT_CAPACITY", 16 << 10)
    receiver, sender = pair
    key, channel = _channel(receiver, sender)
    receiver.expect(key, "big", 0, 50)
    receive_lock = receiver.channel(key).result().lock
    receive_lock.acquire()  # hold the receive loop off, so the ring fills up and the sender blocks
    future = channel.executor.submit(sender.send, channel, "big", 0, kv_of(0, 50))
    time.sleep(0.3)
    assert not future.done()
    receiver.close()
    receive_lock.release()
    with pytest.raises(KVTransferError, match="closed its end"):
        future.result(timeout=5)


def test_an_offer_from_another_host_is_refused_naming_the_setting():
    class Store(dict):
        def wait(self, keys, timeout):
            assert all(k in self for k in keys)

        def set(self, k, v):
            self[k] = v

        def get(self, k):
            return self[k]

    store = Store({"shm/offer": '{"path": "/dev/shm/x", "nonce": 1, "host": "elsewhere/0", "pidns": "", "pid": 1}'})
    with pytest.raises(KVTransferError, match=re.escape("kv_transfer_backend 'shm' needs both workers on one host")):
        kv_shm.attach_ring(store, 1.0)
    assert "error" in store["shm/attached"]  # the receiver hears why at once


@pytest.mark.parametrize("requested,device,peer,expected", [
    ("auto", "cpu", "127.0.0.1:5000", "shm"), ("auto", "cpu", "10.9.9.9:5000", "gloo"),
    ("gloo", "cpu", "127.0.0.1:5000", "gloo"), ("shm", "cpu", "10.9.9.9:5000", "shm"),
    ("auto", "cuda:0", "127.0.0.1:5000", "nccl"), ("shm", "cuda:0", "127.0.0.1:5000", "shm")])
def test_backend_choice(requested, device, peer, expected):
    assert choose_backend(requested, device, peer, "127.0.0.1") == expected


def test_bad_backend_names_the_setting():
    with pytest.raises(ValueError, match=r"kv_transfer_backend='tcp': must be one of auto, shm, gloo, nccl"):
        choose_backend("tcp", "cpu", "127.0.0.1:1", "127.0.0.1")


def test_engine_config_validates_the_backend():
    from workers.config import ConfigError, EngineConfig

    assert EngineConfig(kv_transfer_backend="shm").kv_transfer_backend == "shm"
    with pytest.raises(ConfigError, match=r"kv_transfer_backend='tcp': must be one of auto, shm, gloo, nccl"):
        EngineConfig(kv_transfer_backend="tcp")
    with pytest.raises(ConfigError, match=r"kv_transfer_backend='nccl' with device='cpu'"):
        EngineConfig(kv_transfer_backend="nccl", device="cpu")


@pytest.fixture
def ring_pair():
    """A factory of (sender ring, receiver ring) of a given capacity in this process; unmapped after."""
    made = []

    def make(capacity):
        receiving = kv_shm.ShmRing.create(capacity, timeout_s=5.0)
        sending = kv_shm.ShmRing(receiving.path, receiving.nonce, capacity, 0, timeout_s=5.0)
        os.unlink(receiving.path)
        made.extend([sending, receiving])
        return sending, receiving

    yield make
    for ring in made:
        ring.close()


# a ring of 2 KiB: every block (> a quarter of it) goes through the staged byte stream; 9 KiB: blocks
# go straight into the ring, padded to cache lines, wrapping every few blocks; 1 MiB: no wrap at all
@pytest.mark.parametrize("capacity", [2 << 10, 9 << 10, 1 << 20])
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 8), (torch.bfloat16, 5), (torch.int8, 3)])
def test_block_stream_equals_the_plain_path(ring_pair, capacity, dtype, head_dim):
    """send_blocks/recv_blocks (copy into and out of the ring block by block, hashing each block
    on the way) deliver exactly the tensor and the checksums the plain path gives (block_checksums)."""
    from concurrent.futures import ThreadPoolExecutor

    sending, receiving = ring_pair(capacity)
    g = torch.Generator().manual_seed(capacity + head_dim)
    kv = (torch.randn(3, 2, 11, 4, 2, head_dim, generator=g) * 50).to(dtype)
    out = torch.zeros_like(kv)
    with ThreadPoolExecutor(1) as pool:
        for tag in (5, 6):  # two messages back to back: the stream stays in step across them
            sent = pool.submit(sending.send_blocks, kv, tag)
            got = receiving.recv_blocks(out, tag)
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
            assert sent.result(timeout=5) == got == block_checksums(kv).tolist()
            out.zero_()


def test_a_block_corrupted_in_the_ring_shows_in_its_hash_only(ring_pair):
    sending, receiving = ring_pair(1 << 20)
    kv = kv_of(3, 4)
    sent = sending.send_blocks(kv, 1)  # the whole message fits: nothing read yet
    nb = kv[:, :, 0].nbytes
    first = 64 + 16  # the frame (16 bytes), block 0 from the next cache line, block 1 from the next one after it
    at = first + -(-nb // 64) * 64 + 10
    receiving._bytes[at] ^= 0x40
    got = receiving.recv_blocks(torch.empty_like(kv), 1)
    assert [a != b for a, b in zip(sent, got)] == [False, True, False, False]
