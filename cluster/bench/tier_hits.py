"""Prefix hit rate per KV tier over one phase of `duet bench`, from the worker's own counters.

A worker's LoadReport counts, since it started, the prompt blocks its device prefix cache served
(``prefix_cache_hits``), the blocks loaded back into the device from its host tier
(``tier_host_hits``, those first read back from disk included) and the blocks read back from its
disk tier into host (``tier_disk_hits``) (workers/engine/kv_tiers.py). Read before and after a
phase, the differences over the phase's prompt blocks are its hit rates:

    prompt blocks   sum over the phase's requests of (P - 1) // kv_block_size: the full blocks a
                    request can take from a cache (the last prompt token is always computed)
    device          served in place by the device prefix cache / prompt blocks
    host            loaded from host into the device / prompt blocks
    disk_read_back  read from disk into host / prompt blocks (a subset of ``host`` once loaded)

The same definitions as benchmarks/kv_tiers_bench.py. Exact when every request of the phase ran on
the workers read (self-hosted: the one worker; ``--target``: the ``--worker-endpoint``'s; the
router path behind a router with several workers counts only that worker's share).

Example: 10 requests of 161 prompt tokens (blocks of 16: 10 blocks each, 100 in all), 40 device
hits, 30 host hits of which 10 came from disk -> {"device": 0.4, "host": 0.3, "disk_read_back": 0.1}.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class HitCounters:
    """A worker's cumulative hit counters (LoadReport) at one moment."""

    block_size: int
    device: int
    host: int
    disk_read_back: int

    @classmethod
    def from_report(cls, r: worker_pb2.LoadReport) -> HitCounters:
        return cls(r.kv_block_size, r.prefix_cache_hits, r.tier_host_hits, r.tier_disk_hits)


async def read_counters(stub: worker_pb2_grpc.WorkerStub, timeout: float = 10.0) -> HitCounters:
    return HitCounters.from_report(await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout))


def prompt_blocks(prompt_lengths: Iterable[int], block_size: int) -> int:
    assert block_size > 0
    return sum(max(n - 1, 0) // block_size for n in prompt_lengths)


def hit_rates(before: HitCounters, after: HitCounters, prompt_lengths: Iterable[int]) -> dict[str, Any]:
    """The phase's hit rate per tier (module docstring); zeros for a phase without full blocks."""
    n = prompt_blocks(prompt_lengths, after.block_size) if after.block_size else 0
    out: dict[str, Any] = {"prompt_blocks": n}
    for tier in ("device", "host", "disk_read_back"):
        out[tier] = (getattr(after, tier) - getattr(before, tier)) / n if n else 0.0
    return out
