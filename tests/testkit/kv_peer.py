"""A prefill-side peer process for the KV-transfer tests: a KVSender driven by commands on a queue.

Commands (tuples on ``inbox``), answered on ``outbox``:
    ("send", key, store_address, transfer_id, first_block, num_blocks, seed, mode)
        mode "ok": send kv_of(seed, num_blocks); "corrupt": lie about block 1's checksum;
        "stall": announce and send the header, then stop forever (the test kills us or times out).
    ("exit",)
``backend`` ('gloo' or 'shm') and ``fingerprint`` configure the peer's KVSender.
"""

from __future__ import annotations

import torch

from workers.parallel.launch import helper_process, process_context

LAYOUT_ARGS = (2, 4, 2, 8, torch.float32)  # layers, block size, kv heads, head dim, dtype


def kv_of(seed: int, num_blocks: int) -> torch.Tensor:
    """Deterministic test KV: [L, 2, n, bs, G, D]."""
    L, bs, G, D, dtype = LAYOUT_ARGS
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, num_blocks, bs, G, D, generator=g).to(dtype)


def run_peer(inbox, outbox, timeout_s: float = 10.0, backend: str = "gloo", fingerprint: int = 0) -> None:
    import time

    from workers.kv import channel as kv_channel
    from workers.kv.transfer import KVLayout, KVSender

    sender = KVSender(KVLayout(*LAYOUT_ARGS), backend=backend, timeout_s=timeout_s, fingerprint=fingerprint)
    outbox.put(("ready", 0))
    while True:
        cmd = inbox.get()
        if cmd[0] == "exit":
            return
        _, key, address, tid, first, n, seed, mode = cmd
        try:
            channel = sender.channel(key, address).result(timeout=timeout_s)
            kv = kv_of(seed, n)
            if mode == "corrupt":  # lie about block 1's checksum
                real = kv_channel.checks_of
                kv_channel.checks_of = lambda x, f, *a: real(x, f, *a) + torch.tensor([[0, 0], [0, 1]] + [[0, 0]] * (x.shape[2] - 2))  # noqa: B023 - undone in finally
            if mode == "stall":
                header = kv_channel.encode_header(sender.layout, sender.fingerprint, tid, first, n)
                channel.announce(tid)
                channel.transport.send(header, 1)  # then never the rest
                outbox.put(("stalled", 0))
                time.sleep(3600)
            nbytes = sender.send(channel, tid, first, kv)
            outbox.put(("sent", nbytes))
        except Exception as e:  # noqa: BLE001 - reported to the test
            outbox.put(("error", repr(e)))
        finally:
            if mode == "corrupt":
                kv_channel.checks_of = real


class Peer:
    """The peer process (started as a gang rank is: workers/parallel/launch.py) and its queues;
    ``close`` ends it (killing it if it hangs)."""

    def __init__(self, timeout_s: float = 10.0, backend: str = "gloo", fingerprint: int = 0) -> None:
        ctx = process_context()  # forked from spawn_gang's fork server: torch is imported already
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = helper_process(run_peer, (self.inbox, self.outbox, timeout_s, backend, fingerprint))
        self.proc.start()
        assert self.reply(60) == ("ready", 0)  # imports done: rendezvous timeouts measure the transfer only

    def send(self, key, receiver, tid, first, n, seed, mode="ok") -> None:
        self.inbox.put(("send", key, receiver.address, tid, first, n, seed, mode))

    def reply(self, timeout: float = 30.0):
        return self.outbox.get(timeout=timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            self.inbox.put(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
