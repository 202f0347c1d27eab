"""A prefill-side peer process for the KV-transfer tests: a KVSender driven by commands on a queue.

Commands (tuples on ``inbox``), answered on ``outbox``:
    ("send", key, store_address, transfer_id, first_block, num_blocks, seed, mode)
        mode "ok": send kv_of(seed, num_blocks); "corrupt": lie about block 1's checksum;
        "stall": announce and send the header, then stop forever (the test kills us or times out).
    ("exit",)
"""

from __future__ import annotations

import torch

LAYOUT_ARGS = (2, 4, 2, 8, torch.float32)  # layers, block size, kv heads, head dim, dtype


def kv_of(seed: int, num_blocks: int) -> torch.Tensor:
    """Deterministic test KV: [L, 2, n, bs, G, D]."""
    L, bs, G, D, dtype = LAYOUT_ARGS
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, num_blocks, bs, G, D, generator=g).to(dtype)


def run_peer(inbox, outbox, timeout_s: float = 10.0) -> None:
    import time

    from workers import kv_transfer
    from workers.kv_transfer import KVLayout, KVSender

    sender = KVSender(KVLayout(*LAYOUT_ARGS), timeout_s=timeout_s)
    while True:
        cmd = inbox.get()
        if cmd[0] == "exit":
            return
        _, key, address, tid, first, n, seed, mode = cmd
        try:
            channel = sender.channel(key, address).result(timeout=timeout_s)
            kv = kv_of(seed, n)
            if mode == "corrupt":
                real = kv_transfer.block_checksums
                kv_transfer.block_checksums = lambda x: real(x) + torch.tensor([0, 1] + [0] * (x.shape[2] - 2))
            if mode == "stall":
                header = kv_transfer._encode_header(sender.layout, tid, first, n)
                channel.announce(tid)
                work = channel.group.send([header], 1, 1)  # noqa: F841 - kept alive; never completes the rest
                outbox.put(("stalled", 0))
                time.sleep(3600)
            nbytes = sender.send(channel, tid, first, kv)
            outbox.put(("sent", nbytes))
        except Exception as e:  # noqa: BLE001 - reported to the test
            outbox.put(("error", repr(e)))
        finally:
            if mode == "corrupt":
                kv_transfer.block_checksums = real
