"""A host-tier hit's load path, side by side in one run: the plain path vs the one the engine runs.

    python -m benchmarks.kv_tier_load_bench [--blocks 16] [--reps 41] [--out PATH]

What one admission pays on the engine thread to bring ``--blocks`` blocks back from the host tier
into the device cache (SmolLM2-135M's KV layout: 30 layers, 3 kv heads x 64, block size 16, fp32,
720 KiB a block; CPU, 1 torch thread), before its prefill can start:
    verify   each block's checksum checked (workers/kv/tiers/block_file.py ``verify``):
             plain = the wire's many-block loop (an XXH3 stream of one update per layer's K and V,
             what ``block_checksums`` ran for one block too), engine = ``block_checksums`` of one
             block now (one XXH3 call over the block's bytes: the same value)
    write    the blocks copied into their device blocks: plain = ``torch.cat`` of the blocks then
             one ``index_copy_`` along the cache's block axis (the previous PrefixLoad.write and
             ModelRunner.write_blocks), engine = ``PrefixLoad.write``'s block-by-block copy into
             the cache (ModelRunner.write_blocks on the CPU)
Both paths give the same cache bytes and checksums (asserted here, and in
tests/workers/engine/test_kv_tiers_engine.py / tests/workers/kv/test_kv_transfer.py).
Reported: the median of ``--reps`` repetitions per part and path (the paths alternate repetition by
repetition, so load drift hits both), and engine / plain. Writes JSON to ``--out``. The machine is
shared: note ``uptime`` with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import xxhash

from workers.kv.wire import block_checksums, signed64

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "kv_tier_load_bench.json"
L, BS, G, D, NUM_BLOCKS = 30, 16, 3, 64, 64


def piecewise_checksum(kv: torch.Tensor) -> int:
    """One block's checksum by the loop ``block_checksums`` runs for several blocks (and ran for one
    too before the one-call case): per block, an XXH3 stream over its L * 2 pieces, as int64."""
    host = kv.detach().to("cpu").contiguous()
    rows = host.view(torch.uint8).view(L * 2, host.shape[2], -1).numpy()  # [L*2, n, bytes of one piece]
    out = []
    for i in range(host.shape[2]):
        h = xxhash.xxh3_64()
        for piece in rows[:, i]:
            h.update(piece)
        out.append(signed64(h.intdigest()))
    return int(torch.tensor(out, dtype=torch.int64)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(L, 2, NUM_BLOCKS * BS, G, D)  # the runner's [L, 2, S, G, D]
    view = cache.view(L, 2, NUM_BLOCKS, BS, G, D)
    blocks = [torch.randn(L, 2, 1, BS, G, D, generator=gen) for _ in range(args.blocks)]
    sums = [int(block_checksums(b)[0]) for b in blocks]
    ids = torch.randperm(NUM_BLOCKS, generator=gen)[: args.blocks].tolist()  # allocated blocks: any order

    def verify_plain() -> None:
        assert [piecewise_checksum(b) for b in blocks] == sums

    def verify_engine() -> None:
        assert [int(block_checksums(b)[0]) for b in blocks] == sums

    def write_plain() -> None:
        view.index_copy_(2, torch.tensor(ids), torch.cat(blocks, dim=2))

    def write_engine() -> None:
        for block_id, kv in zip(ids, blocks):
            view[:, :, block_id].copy_(kv[:, :, 0])

    write_plain()
    want = cache.clone()
    cache.zero_()
    write_engine()
    assert torch.equal(cache, want), "the two write paths differ"
    parts = {"verify": (verify_plain, verify_engine), "write": (write_plain, write_engine)}
    times: dict[str, dict[str, list[float]]] = {p: {"plain": [], "engine": []} for p in parts}
    for rep in range(args.reps):
        for part, (plain, engine) in parts.items():
            for name, f in (("plain", plain), ("engine", engine))[:: 1 if rep % 2 else -1]:
                t0 = time.perf_counter()
                f()
                times[part][name].append(time.perf_counter() - t0)
    result = {}
    for part, t in times.items():
        p, e = statistics.median(t["plain"]), statistics.median(t["engine"])
        result[part] = {"plain_ms": p * 1e3, "engine_ms": e * 1e3, "engine_vs_plain": e / p}
        print(f"{part:7s} {args.blocks} blocks: plain {p * 1e3:6.2f} ms  engine {e * 1e3:6.2f} ms  x{e / p:.2f}")
    p = sum(r["plain_ms"] for r in result.values())
    e = sum(r["engine_ms"] for r in result.values())
    result["total"] = {"plain_ms": p, "engine_ms": e, "engine_vs_plain": e / p}
    print(f"total   {args.blocks} blocks: plain {p:6.2f} ms  engine {e:6.2f} ms  x{e / p:.2f}")
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": os.getloadavg(),
               "args": vars(args) | {"out": str(args.out)}, "block_bytes": blocks[0].numel() * 4, "results": result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
