"""The KV transfer wire format: the header, the per-block checksums and the model fingerprint.
Transport-independent: the gloo/NCCL groups and the shared-memory ring (workers/kv/transfer.py,
workers/kv/shm.py) carry the same three messages.

Messages of one transfer, in order:
    header     int64[HEADER_WORDS]: magic, version, layout (layers, block size, kv heads, head dim,
               dtype code), model fingerprint, first logical block, block count, transfer id length,
               then the transfer id's bytes
    payload    [L, 2, n, bs, G, D] in the cache dtype (over gloo/NCCL as one tensor; the shm ring
               carries it block by block, ``ShmRing.send_blocks``, with the same values)
    checks     int64[n, 2]: per block its logical index (a sequence number) and its checksum. Sent
               after the payload so that a sender can hash each block while it copies it out
               (the shm ring does); the receiver checks it against what arrived.

Checksum: per block, XXH3-64 (the ``xxhash`` library) of the block's raw bytes over all its layers,
K before V, layer by layer (the L * 2 contiguous pieces [bs, G, D] of block i, hashed as one
stream). A real hash, unlike a sum of words: it catches a flipped bit, truncation, blocks swapped in
transit (block i's hash lands under index j) and values reordered inside a block. Stored as the
int64 with the same 64 bits.

Model fingerprint (``kv_fingerprint``, workers/engine/runner.py): the first 8 bytes of a SHA-256 over everything that decides what the KV cache of
a token prefix contains: the model's architecture spec (workers/models/config.py ``ModelSpec``:
every field), the cache dtype and the weight format (quantization). Two workers agree on it exactly
when one's KV is valid in the other's cache; a header with another fingerprint is refused before
any payload is used ("a peer with a different model"). It does not hash the weights themselves
(gigabytes): two checkpoints of the same architecture with different weights share a fingerprint,
so deploy one checkpoint per pool.

Worked example::

    head = encode_header(layout, fingerprint, "r1@0", first_block=2, num_blocks=3)
    decode_header(head, layout, fingerprint)        # -> ("r1@0", 2, 3); raises KVTransferError otherwise
    block_checksums(kv)                             # kv [L, 2, 3, bs, G, D] -> int64[3]

Axes: L layers, n blocks in the transfer, bs block size, G kv heads, D head dim.
"""

from __future__ import annotations


import torch
import xxhash

from workers.engine.runner import KVLayout

MAGIC = 0x4455_4554_4B56  # "DUETKV"
VERSION = 3  # 2: XXH3 checksums and the model fingerprint; 3: checks after the payload
TID_BYTES = 64  # transfer ids are at most this long (utf-8)
_FIXED = 11  # header words before the transfer id
HEADER_WORDS = _FIXED + TID_BYTES // 8


class KVTransferError(Exception):
    """A transfer failed or did not verify; its KV must not be used. The pair has been dropped."""


def signed64(h: int) -> int:
    """An unsigned 64-bit hash as the int64 with the same bits (how checks carry it)."""
    return h - (1 << 64) if h >= 1 << 63 else h


def block_checksums(kv: torch.Tensor) -> torch.Tensor:
    """kv [L, 2, n, bs, G, D] (any device) -> int64[n]: per block, XXH3-64 of its bytes (module docstring)."""
    host = kv.detach().to("cpu").contiguous()
    L, two, n = host.shape[:3]
    if n == 1:  # one block (the KV tiers' case): its L * 2 pieces are one run of bytes, hashed in one
        # call (the stream's hash by XXH3's definition; ~2x faster than the 60-odd piece updates)
        return torch.tensor([signed64(xxhash.xxh3_64_intdigest(host.view(torch.uint8).numpy().reshape(-1).data))],
                            dtype=torch.int64)
    rows = host.view(torch.uint8).view(L * two, n, -1).numpy()  # [L*2, n, bytes of one piece]
    out = []
    for i in range(n):
        h = xxhash.xxh3_64()
        for piece in rows[:, i]:
            h.update(piece)
        out.append(signed64(h.intdigest()))
    return torch.tensor(out, dtype=torch.int64)


def encode_header(layout: KVLayout, fingerprint: int, transfer_id: str, first_block: int,
                  num_blocks: int) -> torch.Tensor:
    tid = transfer_id.encode()
    assert 0 < len(tid) <= TID_BYTES, f"transfer id {transfer_id!r} must be 1..{TID_BYTES} bytes"
    head = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    head[:_FIXED] = torch.tensor([MAGIC, VERSION, *layout.as_words(), fingerprint, first_block, num_blocks, len(tid)])
    raw = torch.zeros(TID_BYTES, dtype=torch.uint8)
    raw[: len(tid)] = torch.frombuffer(bytearray(tid), dtype=torch.uint8)
    head[_FIXED:] = raw.view(torch.int64)
    return head


def decode_header(head: torch.Tensor, layout: KVLayout, fingerprint: int) -> tuple[str, int, int]:
    """-> (transfer id, first block, num blocks). Raises KVTransferError on a malformed header, a
    different KV layout or a different model fingerprint (a peer serving another model)."""
    words = head[:_FIXED].tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        raise KVTransferError(f"bad transfer header (magic {words[0]:#x}, version {words[1]}; expected version "
                              f"{VERSION}): stream out of sync or a peer of another release")
    if words[2:7] != layout.as_words():
        raise KVTransferError(f"KV layout mismatch: sender {words[2:7]}, receiver {layout.as_words()} "
                              "(layers, block size, kv heads, head dim, dtype): the workers run different models")
    if words[7] != fingerprint:
        raise KVTransferError(f"model fingerprint mismatch: sender {words[7] & (2**64 - 1):016x}, receiver "
                              f"{fingerprint & (2**64 - 1):016x} (architecture, dtype or quantization differ): "
                              "the peer serves a different model; its KV is refused")
    first_block, num_blocks, tid_len = words[8:11]
    if not 0 < tid_len <= TID_BYTES or num_blocks < 1 or first_block < 0:
        raise KVTransferError(f"bad transfer header (id length {tid_len}, {num_blocks} blocks from {first_block})")
    tid = bytes(head[_FIXED:].view(torch.uint8)[:tid_len].tolist()).decode(errors="replace")
    return tid, first_block, num_blocks


def _checksums(kv: torch.Tensor, hashes: list[int] | None) -> torch.Tensor:
    """int64[n]: the given per-block hashes, or ``block_checksums(kv)`` when there are none."""
    return block_checksums(kv) if hashes is None else torch.tensor(hashes, dtype=torch.int64)


def checks_of(kv: torch.Tensor, first_block: int, hashes: list[int] | None = None) -> torch.Tensor:
    """[n, 2] int64: (logical block index, checksum) per block of kv [L, 2, n, bs, G, D].
    hashes: the blocks' checksums when the caller computed them already (``ShmRing.send_blocks``)."""
    n = kv.shape[2]
    return torch.stack([torch.arange(first_block, first_block + n), _checksums(kv, hashes)], dim=1)


def verify(checks: torch.Tensor, kv: torch.Tensor, first_block: int, hashes: list[int] | None = None) -> str | None:
    """None if ``checks`` match kv's blocks first_block..; else what is wrong (for the error).
    hashes: the checksums of the blocks as they arrived, when the transport computed them while
    receiving (``ShmRing.recv_blocks``); otherwise they are computed from kv here."""
    n = kv.shape[2]
    if checks.shape != (n, 2) or not torch.equal(checks[:, 0], torch.arange(first_block, first_block + n)):
        return f"block sequence numbers {checks[:, 0].tolist()} out of order"
    bad = (checks[:, 1] != _checksums(kv, hashes)).nonzero().view(-1).tolist()
    if bad:
        return f"checksum mismatch in block(s) {[first_block + i for i in bad]}"
    return None
