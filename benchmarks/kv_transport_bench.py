"""KV transfer throughput between two processes of one host: the shared-memory ring vs gloo vs a
plain memory copy of the same bytes, in one run.

    python -m benchmarks.kv_transport_bench [--tokens 2000] [--reps 7] [--backends shm,gloo]

Payload: SmolLM2-135M's KV layout (30 layers, 3 kv heads, head dim 64, float32, 16-token blocks)
for ``--tokens`` tokens (2,000 -> 125 blocks, 92 MB), random values. A sender process (spawned)
runs a KVSender; this process runs the KVReceiver. Per transfer the time runs from the moment the
sender starts ``send`` (CLOCK_MONOTONIC, shared by the processes of one host) to the moment the
receiver's future holds the verified ReceivedKV: announcement, header, checksums of every block on
both sides, the payload, verification. MB/s = payload bytes / that time; median over ``--reps``
transfers after one warm-up (which also builds the pair's channel).

Baselines, the same bytes, medians over the same number of repetitions, in this process:
    memcpy          one libc ``memmove`` call (``ctypes.memmove``: one thread) from a touched
                    source into a preallocated, touched destination: the plain memcpy the target
                    (>= 50%) is judged against. Each side of a transfer is one thread too.
    copy_ threads   ``torch.Tensor.copy_`` with torch's intra-op threads (all cores copying one
                    buffer): what the machine's memory system gives a copy that owns every core.
    fresh           ``copy_`` into a newly allocated tensor each time (what a receiver that
                    allocates its buffer per transfer pays: the page faults of new memory).
Reported: each backend's MB/s and its ratio to each baseline, shm / gloo.
A backend that cannot run here (gloo's TCP mesh in some sandboxes) is recorded with its error.

Noise: run it under the heavy-job lock (``flock /tmp/duet-heavy.lock ...``) on a machine that is
otherwise shared; compare the figures of one run. Writes JSON to ``--out``
(default benchmarks/results/kv_transport_bench.json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "kv_transport_bench.json"
LAYOUT = (30, 16, 3, 64, torch.float32)  # SmolLM2-135M: layers, block size, kv heads, head dim, dtype


def _sender(inbox, outbox, backend: str, num_blocks: int) -> None:
    from workers.kv.transfer import KVLayout, KVSender

    sender = KVSender(KVLayout(*LAYOUT), backend, timeout_s=60.0)
    L, bs, G, D, dtype = LAYOUT
    kv = torch.randn(L, 2, num_blocks, bs, G, D, dtype=dtype)
    outbox.put(("ready", 0.0))
    while True:
        cmd = inbox.get()
        if cmd[0] == "exit":
            return
        _, key, address, tid = cmd
        try:
            channel = sender.channel(key, address).result(timeout=60)
            start = time.monotonic()
            sender.send(channel, tid, 0, kv)
            outbox.put(("sent", start))
        except Exception as e:  # noqa: BLE001 - reported
            outbox.put(("error", repr(e)))


def run_backend(backend: str, num_blocks: int, reps: int) -> dict:
    from workers.kv.transfer import KVLayout, KVReceiver

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(inbox, outbox, backend, num_blocks), daemon=True)
    proc.start()
    receiver = KVReceiver(KVLayout(*LAYOUT), "recv", "inc-r", timeout_s=60.0)
    seconds, nbytes = [], 0
    try:
        assert outbox.get(timeout=120)[0] == "ready"
        key = receiver.pair_key("send", "inc-s", backend)
        receiver.channel(key)
        for i in range(reps + 1):
            fut = receiver.expect(key, f"t{i}", 0, num_blocks)
            inbox.put(("send", key, receiver.address, f"t{i}"))
            status, start = outbox.get(timeout=120)
            if status != "sent":
                raise RuntimeError(start)
            got = fut.result(timeout=120)
            done = time.monotonic()
            if i:  # the first one is the warm-up (it also built the channel)
                seconds.append(done - start)
            nbytes = got.kv.nbytes
    except Exception as e:  # noqa: BLE001 - a backend that cannot run here is recorded, not fatal
        return {"backend": backend, "error": str(e)}
    finally:
        inbox.put(("exit",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        receiver.close()
    med = statistics.median(seconds)
    return {"backend": backend, "payload_bytes": nbytes, "seconds": seconds, "median_s": med,
            "mb_per_s": nbytes / med / 1e6}


def memcpy(num_bytes: int, reps: int, how: str = "memmove") -> dict:
    """Copy ``num_bytes`` ``reps`` times. how: "memmove" (one libc call, one thread, touched
    destination), "threads" (torch copy_ with its intra-op threads, touched destination) or
    "fresh" (torch copy_ into a new tensor each time)."""
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: pages touched
    seconds = []
    for _ in range(reps):
        t = time.perf_counter()
        if how == "memmove":
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
        elif how == "threads":
            dst.copy_(src)
        else:
            torch.empty_like(src).copy_(src)
        seconds.append(time.perf_counter() - t)
    med = statistics.median(seconds)
    return {"how": how, "seconds": seconds, "median_s": med, "mb_per_s": src.nbytes / med / 1e6}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="kv_transport_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--backends", default="shm,gloo")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    num_blocks = -(-args.tokens // LAYOUT[1])
    L, bs, G, D, _ = LAYOUT
    payload = L * 2 * num_blocks * bs * G * D * 4
    base = memcpy(payload, args.reps)
    threads = memcpy(payload, args.reps, "threads")
    fresh = memcpy(payload, args.reps, "fresh")
    results = []
    for backend in args.backends.split(","):
        r = run_backend(backend, num_blocks, args.reps)
        if "mb_per_s" in r:
            r["vs_memcpy"] = r["mb_per_s"] / base["mb_per_s"]
            r["vs_copy_threads"] = r["mb_per_s"] / threads["mb_per_s"]
            r["vs_memcpy_fresh"] = r["mb_per_s"] / fresh["mb_per_s"]
        results.append(r)
        print(f"{backend:>5}: " + (f"{r['mb_per_s']:8.0f} MB/s  ({r['vs_memcpy']:.0%} of memcpy, "
                                   f"{r['vs_copy_threads']:.0%} of a {torch.get_num_threads()}-thread copy, "
                                   f"{r['vs_memcpy_fresh']:.0%} of a copy into fresh memory)"
                                   if "mb_per_s" in r else f"failed: {r['error'][:200]}"))
    print(f"memcpy: {base['mb_per_s']:8.0f} MB/s  ({payload / 1e6:.1f} MB, one thread); copy_ with "
          f"{torch.get_num_threads()} threads {threads['mb_per_s']:.0f} MB/s; into fresh memory {fresh['mb_per_s']:.0f} MB/s")
    by = {r["backend"]: r for r in results}
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": platform.node(),
           "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "torch_threads": torch.get_num_threads(),
           "tokens": args.tokens, "blocks": num_blocks, "payload_bytes": payload, "memcpy": base, "copy_threads": threads,
           "memcpy_fresh": fresh,
           "backends": results}
    if "mb_per_s" in by.get("shm", {}) and "mb_per_s" in by.get("gloo", {}):
        out["shm_vs_gloo"] = by["shm"]["mb_per_s"] / by["gloo"]["mb_per_s"]
        print(f"shm / gloo: {out['shm_vs_gloo']:.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
