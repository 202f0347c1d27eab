"""Hit rate per KV tier in `duet bench` (cluster/bench/tier_hits.py): counter differences over the
phase's prompt blocks, read from a worker's LoadReport."""

from __future__ import annotations

from testkit.tolerance import EXACT

from cluster.bench.tier_hits import HitCounters, hit_rates, prompt_blocks
from protos.duet.worker.v1 import worker_pb2


def test_docstring_example():
    before = HitCounters(16, device=5, host=7, disk_read_back=1)
    after = HitCounters(16, device=45, host=37, disk_read_back=11)
    assert prompt_blocks([161] * 10, 16) == 100
    # integer counts over 100: one correctly rounded division each, so the same doubles as the literals
    assert hit_rates(before, after, [161] * 10) == EXACT.approx({"prompt_blocks": 100, "device": 0.4, "host": 0.3,
                                                                 "disk_read_back": 0.1})


def test_the_last_prompt_token_is_never_a_hit_and_no_blocks_is_zero():
    assert prompt_blocks([16, 17, 33, 1, 0], 16) == 0 + 1 + 2
    zero = HitCounters(16, 0, 0, 0)
    assert hit_rates(zero, zero, [10]) == {"prompt_blocks": 0, "device": 0.0, "host": 0.0, "disk_read_back": 0.0}


def test_counters_come_from_the_load_report():
    report = worker_pb2.LoadReport(kv_block_size=16, prefix_cache_hits=3, tier_host_hits=4, tier_disk_hits=2)
    assert HitCounters.from_report(report) == HitCounters(16, 3, 4, 2)
