"""``duet drain`` without a cluster: which workers a drain picks (by id or node IP), where their
requests may go (the other serving workers of the pool), the text it prints, bad input named;
and ``duet status`` showing a worker's migrations. The drain itself (Drain RPC) is tested in
tests/workers/handoff/test_migration_service.py."""

from __future__ import annotations

import pytest

from cluster.cli import main
from cluster.deploy.drain import DrainError, format_results, select, targets_for
from cluster.deploy.status import format_status

LOAD = dict(num_running=0, num_waiting=0, outstanding_tokens=0, kv_blocks_used=0, kv_blocks_total=10,
            prefix_cache_queries=0, prefix_cache_hits=0, spec_method="none", migrations_out=0, migrations_in=0,
            migration_failures=0, migration_kv_bytes=0, draining=False)
WORKERS = [
    {"pool": "decode", "worker_id": "decode-0", "endpoint": "10.0.0.5:4001", "incarnation": "a", "health": "SERVING"},
    {"pool": "decode", "worker_id": "decode-1", "endpoint": "10.0.0.6:4002", "incarnation": "b", "health": "SERVING"},
    {"pool": "decode", "worker_id": "decode-2", "endpoint": "10.0.0.6:4003", "incarnation": "c", "health": "NOT_SERVING"},
    {"pool": "decode", "worker_id": "decode-3", "endpoint": "10.0.0.7:4004", "incarnation": "d", "health": "SERVING"},
    {"pool": "prefill", "worker_id": "prefill-0", "endpoint": "10.0.0.5:4005", "incarnation": "e", "health": "SERVING"},
]


def test_select_by_id_or_node_and_targets_are_the_pools_serving_others():
    assert [w["worker_id"] for w in select(WORKERS, "decode-1", None)] == ["decode-1"]
    on_node = select(WORKERS, None, "10.0.0.6")
    assert [w["worker_id"] for w in on_node] == ["decode-1", "decode-2"]
    names = {w["worker_id"] for w in on_node}
    # not the other victim on the node, not a NOT_SERVING one, not another pool's
    assert [t[0] for t in targets_for(on_node[0], WORKERS, names)] == ["decode-0", "decode-3"]
    with pytest.raises(DrainError, match="decode-9"):
        select(WORKERS, "decode-9", None)
    with pytest.raises(DrainError, match="10.9.9.9"):
        select(WORKERS, None, "10.9.9.9")


def test_drafter_replicas_are_never_drained_and_status_shows_them():
    drafter = {"pool": "drafters", "worker_id": "drafters-0", "endpoint": "10.0.0.6:4100", "incarnation": "f",
               "health": "SERVING", "role": "drafter", "pid": 7,
               "load": {"num_requests": 3, "num_active": 2, "num_streams": 2, "kv_blocks_used": 5, "kv_blocks_total": 400,
                        "batched_rows": 26, "forward_passes": 10, "rounds": 812, "draft_tokens": 2904, "evictions": 0,
                        "expired": 1}}
    workers = [*WORKERS, drafter]
    assert [w["worker_id"] for w in select(workers, None, "10.0.0.6")] == ["decode-1", "decode-2"]
    with pytest.raises(DrainError, match="drafters-0"):
        select(workers, "drafters-0", None)
    text = format_status({"workers": [drafter]})
    assert "pool drafters: 1 drafters" in text
    assert "requests 3 (drafting 2)  streams 2  KV 5/400 blocks  mean batch 2.6" in text
    assert "rounds 812, 2904 draft tokens, 0 evicted, 1 expired" in text


def test_results_text_and_cli_argument_errors(capsys):
    text = format_results([{"worker_id": "decode-1", "migrated": 8, "failed": 0, "remaining": 0, "seconds": 0.4,
                            "targets": ["decode-0"]},
                           {"worker_id": "decode-2", "error": "gRPC: UNAVAILABLE: down"}])
    assert text.splitlines() == ["decode-1: 8 requests migrated, 0 failed attempts, 0 left, 0.40 s",
                                 "decode-2: not drained (gRPC: UNAVAILABLE: down)"]
    assert main(["drain"]) == 1
    assert main(["drain", "decode-1", "--node-ip", "10.0.0.6"]) == 1
    assert main(["drain", "decode-1", "--timeout", "0"]) == 1
    err = capsys.readouterr().err
    assert "exactly one of WORKER or --node-ip" in err and "--timeout must be > 0" in err


def test_status_shows_migrations_and_draining():
    ld = LOAD | {"migrations_out": 8, "migration_kv_bytes": 36_900_000, "draining": True}
    status = {"router": None, "workers": [{"pool": "decode", "worker_id": "decode-1", "endpoint": "10.0.0.6:4002",
                                           "health": "NOT_SERVING", "pid": 7, "load": ld}]}
    text = format_status(status)
    assert "migrations: 8 out, 0 in, 0 failed, 36.9 MB; draining" in text
    quiet = format_status({"router": None, "workers": [{**status["workers"][0], "load": LOAD}]})
    assert "migrations" not in quiet
