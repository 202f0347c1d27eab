"""The lower KV tiers' stores without an engine: host LRU under its byte budget, spill to disk and
read back (asynchronously, verified), a corrupt or foreign disk block refused and counted, and no
file left after close."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from workers.engine.kv_tiers import key_digest, next_digest, ROOT_DIGEST
from workers.engine.runner import KVLayout
from workers.kv.tiers.block_file import BlockRefused, decode, encode, seal
from workers.kv.tiers.disk import DiskTier
from workers.kv.tiers.host import HostTier
from workers.kv.tiers.store import TieredStore

LAYOUT = KVLayout(2, 4, 2, 8, torch.float32)  # L=2, bs=4, G=2, D=8: 1 KiB a block (float32)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 2, 1, 4, 2, 8, generator=g)


def digest(i: int) -> bytes:
    return next_digest(ROOT_DIGEST, [i, i + 1, i + 2, i + 3])


def settle(store: TieredStore, digests: list[bytes], timeout: float = 10.0) -> None:
    """Poll until no read of ``digests`` is in flight (the engine does this once per step)."""
    end = time.monotonic() + timeout
    while any(store.prefetch(d) for d in digests):
        assert time.monotonic() < end, "disk reads did not finish"
        store.wait(0.05)
        store.poll()


def test_digest_names_the_whole_prefix():
    k1 = (None, (1, 2, 3, 4))
    k2 = (k1, (5, 6, 7, 8))
    assert key_digest(k2) == next_digest(next_digest(ROOT_DIGEST, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert key_digest(k2) != key_digest(((None, (0, 2, 3, 4)), (5, 6, 7, 8)))  # same tokens, other parent


def test_digest_bytes_are_those_of_the_torch_int64_encoding():
    """next_digest hashes the tokens' int64 bytes through numpy (faster): the same digests as the
    plain torch encoding it replaced, so blocks written before stay found."""
    import xxhash

    for tokens in ([1, 2, 3, 4], [0, 49151, 2**40, 7], list(range(100, 116))):
        h = xxhash.xxh3_128(ROOT_DIGEST)
        h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
        assert next_digest(ROOT_DIGEST, tokens) == h.digest()
        assert next_digest(ROOT_DIGEST, tuple(tokens)) == h.digest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_file_equals_the_encoded_bytes(tmp_path: Path, dtype):
    """block_file.write (header, then the payload straight from the tensor: no copy) writes exactly
    encode's bytes."""
    from workers.kv.tiers.block_file import HEADER_WORDS, read, write

    b = seal(digest(3), block(3).to(dtype), chain_hash=2**63 + 5)
    layout = KVLayout(2, 4, 2, 8, dtype)
    with open(tmp_path / "b.kvb", "wb") as f:
        write(f, b, 7, layout)
    raw = (tmp_path / "b.kvb").read_bytes()
    assert raw == encode(b, 7, layout)
    back = decode(raw, b.digest, 7, layout)
    assert torch.equal(back.kv, b.kv) and back.chain_hash == 2**63 + 5
    # read(): one buffer the decoded tensor is a view of, decoded to the same block
    buf = read(tmp_path / "b.kvb")
    again = decode(buf, b.digest, 7, layout)
    assert torch.equal(again.kv, b.kv) and again.checksum == b.checksum
    assert again.kv.data_ptr() == torch.frombuffer(buf, dtype=torch.uint8).data_ptr() + HEADER_WORDS * 8  # no copy
    (tmp_path / "b.kvb").write_bytes(raw[:-3])  # cut short
    with pytest.raises(BlockRefused) as e:
        decode(read(tmp_path / "b.kvb"), b.digest, 7, layout)
    assert e.value.kind == "corrupt"


def test_block_file_round_trip_and_refusals():
    b = seal(digest(1), block(1))
    raw = encode(b, 7, LAYOUT)
    back = decode(raw, b.digest, 7, LAYOUT)
    assert torch.equal(back.kv, b.kv) and back.checksum == b.checksum
    with pytest.raises(BlockRefused) as e:
        decode(raw, b.digest, 8, LAYOUT)  # another model's fingerprint
    assert e.value.kind == "foreign"
    flipped = bytearray(raw)
    flipped[-5] ^= 0x10  # one bit of the payload
    with pytest.raises(BlockRefused) as e:
        decode(bytes(flipped), b.digest, 7, LAYOUT)
    assert e.value.kind == "corrupt"
    with pytest.raises(BlockRefused) as e:
        decode(raw, digest(2), 7, LAYOUT)  # the file of another block
    assert e.value.kind == "corrupt"
    with pytest.raises(BlockRefused):
        decode(raw[:-4], b.digest, 7, LAYOUT)  # truncated


def test_host_lru_budget():
    host = HostTier(2 * BLOCK_BYTES)
    a, b, c = (seal(digest(i), block(i)) for i in range(3))
    assert host.put(a) == [] and host.put(b) == []
    host.get(a.digest)  # a is now the most recent
    assert [v.digest for v in host.put(c)] == [b.digest]
    assert a.digest in host and c.digest in host and host.bytes == 2 * BLOCK_BYTES


def test_spill_to_disk_and_read_back(tmp_path: Path):
    disk = DiskTier(64 * BLOCK_BYTES, 7, LAYOUT, str(tmp_path))
    store = TieredStore(HostTier(2 * BLOCK_BYTES), disk)
    for i in range(5):
        store.put(digest(i), block(i))
    assert [store.where(digest(i)) for i in range(5)] == ["disk", "disk", "disk", "host", "host"]
    assert store.prefetch(digest(0))  # a read in flight; nothing waits for it here
    settle(store, [digest(0)])
    assert store.where(digest(0)) == "host"
    assert torch.equal(store.get(digest(0)), block(0))
    s = store.stats()
    assert (s.disk_hits, s.stored_blocks, s.refused_corrupt) == (1, 5, 0)
    assert s.host_evictions == 4 and s.bytes_to_disk == 4 * BLOCK_BYTES
    directory = disk.dir
    assert list(directory.glob("*.kvb"))
    store.close()
    assert not directory.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "foreign"])
def test_damaged_disk_block_is_refused_and_counted(tmp_path: Path, damage: str):
    disk = DiskTier(64 * BLOCK_BYTES, 7, LAYOUT, str(tmp_path))
    store = TieredStore(HostTier(BLOCK_BYTES), disk)
    store.put(digest(0), block(0))
    store.put(digest(1), block(1))  # block 0 spills to disk
    disk._pool.submit(lambda: None).result()  # the write has landed
    path = disk.path(digest(0))
    raw = bytearray(path.read_bytes())
    if damage == "bitflip":
        raw[-1] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[16:24] = (8).to_bytes(8, "little")  # the fingerprint word: another model's block
    path.write_bytes(bytes(raw))
    assert store.prefetch(digest(0))
    settle(store, [digest(0)])
    assert store.where(digest(0)) is None  # dropped, never served
    s = store.stats()
    assert (s.refused_foreign if damage == "foreign" else s.refused_corrupt) == 1 and s.disk_hits == 0
    store.close()


def test_corrupt_host_block_is_refused():
    store = TieredStore(HostTier(4 * BLOCK_BYTES))
    store.put(digest(0), block(0))
    store.host.get(digest(0)).kv[0, 0, 0, 0, 0, 0] += 1.0  # memory went bad after the checksum
    assert store.get(digest(0)) is None and store.where(digest(0)) is None
    assert store.stats().refused_corrupt == 1


def test_disk_budget_deletes_lru_files(tmp_path: Path):
    disk = DiskTier(2 * BLOCK_BYTES, 7, LAYOUT, str(tmp_path))
    store = TieredStore(HostTier(BLOCK_BYTES), disk)
    for i in range(5):
        store.put(digest(i), block(i))
    disk._pool.submit(lambda: None).result()
    assert len(disk) == 2 and len(list(disk.dir.glob("*.kvb"))) == 2
    assert store.stats().disk_evictions == 2
    store.close()
