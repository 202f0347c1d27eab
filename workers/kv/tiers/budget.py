"""The host tier's budget when ``cache.host_tier_bytes`` is 'auto' (the default), and the memory
reading it rests on.

Rule (``host_tier_budget``): twice the device cache's bytes (device + host then hold three times
what the device alone does; SGLang's HiCache takes the same ratio by default), but at most a quarter
of the memory the worker could still take when it
builds its engine (``memory_headroom_bytes``: the machine's available memory and, under a cgroup
limit such as a pod's, what is left below that limit); off when prefix caching is off (the tiers
keep prefix-cached blocks) or when the result holds less than one block. The host tier takes
memory block by block as the device evicts; nothing is reserved up front.

Why on by default: a prefix the device evicted is loaded back instead of recomputed (a copy
instead of a prefill, once histories outgrow the device cache), and with no hits the tier costs
about nothing (benchmarks/README.md, kv_tiers_bench). The disk tier stays off by
default: it pays only once the host tier is full and a read beats recomputing, which depends on
the disk; it is offered, not assumed.

Example::

    host_tier_budget(CacheConfig(), device_cache_bytes=1 << 30, block_bytes=720 << 10,
                     headroom_bytes=16 << 30)        # 2 GiB: twice the device cache
    host_tier_budget(CacheConfig(), 1 << 30, 720 << 10, 4 << 30)    # 1 GiB: a quarter of the headroom
    host_tier_budget(CacheConfig(host_tier_bytes=0), 1 << 30, 720 << 10, 16 << 30)    # 0: off
"""

from __future__ import annotations

from pathlib import Path

from workers.config import CacheConfig

DEVICE_MULTIPLE = 2  # auto: this many times the device cache's bytes...
HEADROOM_SHARE = 4  # ...but at most 1 / HEADROOM_SHARE of the memory still free at start
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


def host_tier_budget(cache: CacheConfig, device_cache_bytes: int, block_bytes: int, headroom_bytes: int) -> int:
    """The host tier's byte budget (0 = off) for ``cache``: its own ``host_tier_bytes`` when that is a
    number, else the rule in the module docstring."""
    if cache.host_tier_bytes != "auto":
        return int(cache.host_tier_bytes)
    if not cache.enable_prefix_caching:
        return 0
    budget = min(DEVICE_MULTIPLE * device_cache_bytes, headroom_bytes // HEADROOM_SHARE)
    return budget if budget >= block_bytes else 0


def memory_headroom_bytes(cgroup_root: Path = CGROUP_ROOT, meminfo: Path = MEMINFO) -> int:
    """Bytes this process could still take: the machine's available memory (the kernel's estimate,
    ``MemAvailable`` in /proc/meminfo; read here rather than through psutil, which the GPU check's bare
    machines may lack), capped by the room left under its cgroup's memory limit (v2 ``memory.max`` -
    ``memory.current``, or v1's ``memory/memory.limit_in_bytes`` - ``memory/memory.usage_in_bytes``)
    when one is set."""
    available = _available(meminfo)
    room = _cgroup_room(cgroup_root)
    return available if room is None else max(0, min(available, room))


def _available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):  # "MemAvailable:   12345678 kB"
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line (Linux 3.14 or later has it)")


def _cgroup_room(root: Path) -> int | None:
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes ~2^63 for "none"
            return None
        return int(limit) - usage
    return None
