"""Lower KV tiers of one worker: host memory and local disk, each with a byte budget (LRU).

    block_file.py  a block below the device: header (fingerprint, layout, digest, checksum) + payload
    host.py        HostTier: blocks in host memory (pinned for a GPU runner), LRU
    node.py        NodeTier: a CPU worker's host tier in the node's shared memory (/dev/shm), one copy
                   per node and model, shared by the node's workers and kept across a restart
    disk.py        DiskTier: blocks as files in a per-process directory, written and read on one
                   background thread, LRU, removed at close
    store.py       TieredStore: host over disk, verification and counters (the engine's TierStore,
                   workers/engine/kv_tiers.py)
    budget.py      the host tier's 'auto' budget (the default): twice the device cache, at most a
                   quarter of the memory free at start
"""
