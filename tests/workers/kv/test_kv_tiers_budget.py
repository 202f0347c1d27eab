"""The host tier's 'auto' budget (workers/kv/tiers/budget.py): twice the device cache, capped by a
quarter of the memory still free, off without prefix caching or below one block; an explicit size
is kept as it is; the headroom reads a cgroup v2 or v1 limit when one is set and ignores 'max'."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.config import CacheConfig
from workers.kv.tiers.budget import DEVICE_MULTIPLE, HEADROOM_SHARE, host_tier_budget, memory_headroom_bytes

BLOCK = 720 << 10
GIB = 1 << 30


@pytest.mark.parametrize("cache, device, headroom, want", [
    (CacheConfig(), GIB, 16 * GIB, DEVICE_MULTIPLE * GIB),                  # twice the device cache
    (CacheConfig(), GIB, 2 * GIB, 2 * GIB // HEADROOM_SHARE),               # a quarter of the headroom
    (CacheConfig(), GIB, 2 * BLOCK, 0),                                     # less than a block: off
    (CacheConfig(enable_prefix_caching=False), GIB, 16 * GIB, 0),           # nothing to keep: off
    (CacheConfig(host_tier_bytes=0), GIB, 16 * GIB, 0),                     # explicitly off
    (CacheConfig(host_tier_bytes=3 * GIB), GIB, BLOCK, 3 * GIB),            # a size is taken as it is
])
def test_budget(cache, device, headroom, want):
    assert host_tier_budget(cache, device, BLOCK, headroom) == want


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_headroom_is_capped_by_a_cgroup_v2_limit(tmp_path):
    free = memory_headroom_bytes(tmp_path)  # no cgroup files: the machine's available memory
    assert free > 0
    room = min(free, 1 << 30) // 2
    assert memory_headroom_bytes(_cgroup(tmp_path / "v2", {"memory.max": str(room + 4096),
                                                           "memory.current": "4096"})) == room


def test_available_memory_is_the_kernels_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    assert memory_headroom_bytes(tmp_path, meminfo) == 8000000 * 1024  # no cgroup files under tmp_path
    with_limit = _cgroup(tmp_path / "v2", {"memory.max": str(4 << 30), "memory.current": str(1 << 30)})
    assert memory_headroom_bytes(with_limit, meminfo) == 3 << 30


def test_headroom_v1_and_unlimited(tmp_path):
    free = memory_headroom_bytes(tmp_path)
    room = min(free, 1 << 30) // 2
    v1 = _cgroup(tmp_path / "v1", {"memory/memory.limit_in_bytes": str(room + 100),
                                   "memory/memory.usage_in_bytes": "100"})
    assert memory_headroom_bytes(v1) == room
    # no limit: v2 writes 'max', v1 a number near 2^63; the machine's memory decides
    unlimited_v2 = _cgroup(tmp_path / "u2", {"memory.max": "max", "memory.current": "100"})
    unlimited_v1 = _cgroup(tmp_path / "u1", {"memory/memory.limit_in_bytes": str(2**63 - 4096),
                                             "memory/memory.usage_in_bytes": "100"})
    for root in (unlimited_v2, unlimited_v1):
        assert memory_headroom_bytes(root) > room
    over = _cgroup(tmp_path / "over", {"memory.max": "1000", "memory.current": "2000"})
    assert memory_headroom_bytes(over) == 0  # past its limit: no room
