"""`duet status` and /metrics show KV transfers, prefix pulls and KV tiers: the status text gains a line per
worker that moved KV or pulled prefixes, and every worker counter the metrics exporter reads is a
LoadReport field."""

from __future__ import annotations

from cluster.deploy.status import format_status
from protos.duet.worker.v1 import worker_pb2
from router.prometheus import WORKER_COUNTERS


def _worker(**load) -> dict:
    base = dict(num_running=0, num_waiting=0, outstanding_tokens=0, kv_blocks_used=0, kv_blocks_total=10,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, spec_method="none")
    return {"pool": "p", "worker_id": "w1", "endpoint": "h:1", "health": "SERVING", "pid": 1, "load": base | load}


def test_status_shows_transfers_and_pulls_only_when_there_are_some():
    quiet = format_status({"workers": [_worker()]})
    assert "prefix pulls" not in quiet and "KV transfers" not in quiet
    busy = format_status({"workers": [_worker(
        kv_transfers_sent=1, kv_transfers_received=2, kv_bytes_sent=5_000_000, kv_bytes_received=3_000_000,
        kv_transfer_failures=1, prefix_pulls=2, prefix_pull_blocks=250, prefix_pull_bytes=4_000_000,
        prefix_pull_failures=1, prefix_pulls_served=3)]})
    assert "KV transfers: sent 1 (5.0 MB), received 2 (3.0 MB), 1 failed" in busy
    assert "prefix pulls: 2 pulled (250 blocks, 4.0 MB), 1 fell back to recompute, 3 served" in busy
    from_tiers = format_status({"workers": [_worker(
        prefix_pulls=0, prefix_pull_blocks=0, prefix_pull_bytes=0, prefix_pull_failures=0, prefix_pulls_served=3,
        prefix_pull_tier_blocks_served=40)]})
    assert "3 served (40 blocks from its KV tiers)" in from_tiers


def test_every_exported_worker_counter_is_a_load_report_field():
    fields = set(worker_pb2.LoadReport.DESCRIPTOR.fields_by_name)
    names = [f for f, _, _ in WORKER_COUNTERS]
    assert {"prefix_pulls", "prefix_pull_bytes", "prefix_pull_failures"} <= set(names) and set(names) <= fields


def test_status_shows_kv_tiers_only_when_on():
    assert "KV tiers" not in format_status({"workers": [_worker()]})
    busy = format_status({"workers": [_worker(
        tier_host_bytes=8_000_000, tier_disk_bytes=20_000_000, tier_host_hits=12, tier_disk_hits=3,
        tier_host_evictions=40, tier_disk_evictions=1, tier_refused_corrupt=2, tier_refused_foreign=0,
        tier_deadline_misses=1, tier_bytes_to_host=30_000_000, tier_bytes_to_disk=10_000_000,
        tier_bytes_loaded=9_000_000, tier_load_seconds=0.03)]})
    assert ("KV tiers: host 8.0 MB (12 hits, 40 evicted), disk 20.0 MB (3 hits, 1 evicted), refused 2 corrupt / "
            "0 foreign, 1 deadline misses") in busy
    assert "KV tiers moved: 30.0 MB to host, 10.0 MB to disk, 9.0 MB loaded back; load 2.50 ms per block" in busy
    fields = set(worker_pb2.LoadReport.DESCRIPTOR.fields_by_name)
    from router.prometheus import WORKER_GAUGES

    assert {f for f, _, _ in WORKER_COUNTERS + WORKER_GAUGES if f.startswith("tier_")} == {
        f for f in fields if f.startswith("tier_")}
