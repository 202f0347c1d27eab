"""Moving KV blocks between worker processes, and nothing else (who moves what: workers/handoff/).

    wire.py      the header, per-block checksums and layout words every transport carries
    channel.py   a process group per (sender, receiver) pair, created lazily (gloo / NCCL)
    shm.py       the shared-memory ring between processes on one node (block streams)
    buffers.py   receive buffers reused once every tensor viewing them is gone
    transfer.py  KVSender / KVReceiver over whichever transport the pair has
    tiers/       one worker's KV below its device cache: host memory and local disk (checksummed,
                 fingerprinted blocks; the engine side is workers/engine/kv_tiers.py)
"""
