"""One KV block below the device, as the tiers keep it: the payload plus what proves it.

A block leaving the device carries its checksum (XXH3-64 of its bytes, as the transfer wire
computes it: workers/kv/wire.py ``block_checksums``) and the model fingerprint
(workers/engine/runner.py ``kv_fingerprint``). In host memory those ride beside the tensor
(``TierBlock``); on disk they lead the file:

    header   int64[HEADER_WORDS]: magic, version, fingerprint, layout words (layers, block size,
             kv heads, head dim, dtype code), checksum, payload bytes, digest (2 words), chain hash
    payload  the block's bytes, [L, 2, 1, bs, G, D] in the cache dtype

The chain hash (workers/block_hash.py) is the name routers know the block by: a worker sharing
the node's tier reads it from a neighbour's file to report that block (``read_chain_hash``). It is
not part of the block's identity (the digest is) and is not checked: a wrong one costs a routing
guess, never a wrong answer. 0 (the chain's root, never a block's hash) means unknown.

``decode`` refuses a block whose fingerprint or layout is another model's (``foreign``) or whose
digest, size or checksum does not match (``corrupt``); a refused block is never served.

Worked example::

    raw = encode(block, fingerprint, layout)        # bytes to write (``write``: into a file, no copy)
    decode(raw, digest, fingerprint, layout)        # -> TierBlock; raises BlockRefused otherwise
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from workers.engine.runner import KVLayout
from workers.kv.wire import block_checksums

MAGIC = 0x4455_4554_5449_4552  # "DUETTIER"
VERSION = 2  # 2: the chain hash after the digest
HEADER_WORDS = 13
CHAIN_HASH_WORD = 12


class BlockRefused(Exception):
    """A block that must not be used. kind: 'corrupt' or 'foreign'."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TierBlock:
    digest: bytes
    kv: torch.Tensor  # [L, 2, 1, bs, G, D], CPU, contiguous
    checksum: int  # block_checksums(kv)[0] when it left the device
    chain_hash: int = 0  # the block's name for routers (workers/block_hash.py); 0: unknown

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def seal(digest: bytes, kv: torch.Tensor, chain_hash: int = 0) -> TierBlock:
    """A block fresh from the device, with its checksum."""
    kv = kv.contiguous()
    return TierBlock(digest, kv, int(block_checksums(kv)[0]), chain_hash)


def verify(block: TierBlock) -> None:
    """Raises BlockRefused('corrupt') when the payload no longer matches its checksum."""
    got = int(block_checksums(block.kv)[0])
    if got != block.checksum:
        raise BlockRefused("corrupt", f"block {block.digest.hex()}: checksum {got & (2**64 - 1):016x}, "
                           f"stored {block.checksum & (2**64 - 1):016x}")


def block_shape(layout: KVLayout) -> tuple[int, ...]:
    return (layout.num_layers, 2, 1, layout.block_size, layout.num_kv_heads, layout.head_dim)


def block_nbytes(layout: KVLayout) -> int:
    """A block's payload bytes (every layer's K and V, every kv head)."""
    return math.prod(block_shape(layout)) * layout.dtype.itemsize


def encode(block: TierBlock, fingerprint: int, layout: KVLayout) -> bytes:
    """The file's bytes: ``header(...)`` then ``payload(block)``, in one copy."""
    return header(block, fingerprint, layout) + payload(block).tobytes()


def header(block: TierBlock, fingerprint: int, layout: KVLayout) -> bytes:
    d = int.from_bytes(block.digest, "little", signed=False)
    words = [MAGIC, VERSION, fingerprint, *layout.as_words(), block.checksum, block.nbytes,
             _signed(d & (2**64 - 1)), _signed(d >> 64), _signed(block.chain_hash)]
    return np.array(words, dtype=np.int64).tobytes()


def payload(block: TierBlock) -> np.ndarray:
    """The block's bytes without a copy (a view of its tensor, which no one writes once sealed): a
    writer hands it to ``file.write`` after ``header``."""
    return block.kv.view(torch.uint8).numpy().reshape(-1)


def write(f: BinaryIO, block: TierBlock, fingerprint: int, layout: KVLayout) -> None:
    """Write the block's file (header, payload) to ``f`` without copying the payload."""
    f.write(header(block, fingerprint, layout))
    f.write(payload(block).data)  # the ndarray's memoryview


def read(path: str | os.PathLike) -> bytearray:
    """A block file's bytes, read once into a writable buffer ``decode`` uses without copying.
    Raises FileNotFoundError / OSError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = bytearray(size)
        n = f.readinto(raw)
    return raw if n == size else raw[:n]  # (a file cut short meanwhile: decode refuses it)


def decode(raw: bytes | bytearray, digest: bytes, fingerprint: int, layout: KVLayout) -> TierBlock:
    """The block in ``raw`` (a file's bytes: ``read``), verified. Raises BlockRefused. A bytearray
    is used in place: the block's tensor is a view of it (no copy of the payload)."""
    n_head = HEADER_WORDS * 8
    if len(raw) < n_head:
        raise BlockRefused("corrupt", f"block {digest.hex()}: {len(raw)} bytes, shorter than its header")
    words = np.frombuffer(raw, dtype=np.int64, count=HEADER_WORDS).tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        raise BlockRefused("corrupt", f"block {digest.hex()}: bad magic or version ({words[0]:#x}, {words[1]})")
    if words[2] != fingerprint or words[3:8] != layout.as_words():
        raise BlockRefused("foreign", f"block {digest.hex()}: model fingerprint {words[2] & (2**64 - 1):016x} / "
                           f"layout {words[3:8]}, this worker {fingerprint & (2**64 - 1):016x} / "
                           f"{layout.as_words()}: another model's KV is refused")
    d = int.from_bytes(digest, "little", signed=False)
    if words[10:12] != [_signed(d & (2**64 - 1)), _signed(d >> 64)]:
        raise BlockRefused("corrupt", f"block {digest.hex()}: the file holds another block's digest")
    n_payload = len(raw) - n_head
    dtype = layout.dtype
    want = block_nbytes(layout)
    if words[9] != n_payload or n_payload != want:
        raise BlockRefused("corrupt", f"block {digest.hex()}: {n_payload} payload bytes, header says "
                           f"{words[9]}, a block is {want}")
    buf = raw if isinstance(raw, bytearray) else bytearray(raw)  # torch.frombuffer wants a writable buffer
    # n_head (104 bytes) is a multiple of every KV element size, so the dtype view needs no copy
    kv = torch.frombuffer(buf, dtype=torch.uint8, offset=n_head, count=n_payload).view(dtype).view(block_shape(layout))
    block = TierBlock(digest, kv, words[8], words[CHAIN_HASH_WORD] & (2**64 - 1))
    verify(block)
    return block


def read_chain_hash(head: bytes) -> int | None:
    """The chain hash in a block file's first HEADER_WORDS * 8 bytes (None: unknown, or not a block
    file of this version). Nothing else is checked: ``decode`` does that when the block is read."""
    if len(head) < HEADER_WORDS * 8:
        return None
    words = np.frombuffer(head, dtype=np.int64, count=HEADER_WORDS).tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        return None
    return (words[CHAIN_HASH_WORD] & (2**64 - 1)) or None


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u
