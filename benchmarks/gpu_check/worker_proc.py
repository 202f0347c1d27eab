"""A worker process for gpu-check: one engine behind the worker gRPC service (no Ray). Writes
{endpoint, worker_id, incarnation} to --ready once serving; stops when its stdin closes."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path


async def serve(args: argparse.Namespace) -> None:
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.server.service import start_worker_server

    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=1024,
                       cache=CacheConfig(kv_cache_memory_bytes=args.kv_bytes),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64))
    server = await start_worker_server(cfg, worker_id=args.id, kv_transfer_backend=args.kv_backend)
    tmp = Path(args.ready).with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoint": server.endpoint, "worker_id": server.worker_id,
                               "incarnation": server.incarnation}))
    tmp.replace(args.ready)
    await asyncio.to_thread(sys.stdin.read)  # returns at EOF: the parent closed our stdin
    await server.stop(grace=2)


def main() -> None:
    from benchmarks.gpu_check.harness import apply_module_blocks

    apply_module_blocks()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-backend", default="auto")
    ap.add_argument("--kv-bytes", type=int, default=1 << 30)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--id", default="w")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
