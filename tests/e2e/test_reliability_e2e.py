"""Reliability on a local Ray deployment (benchmarks/reliability_bench.py's phases, shortened), one
deployment of two workers for the module: first a bounded soak (steady Poisson load: every request
completes, every KV block is free once idle, memory does not climb), then chaos (a closed loop of
clients sending greedy requests while a random worker is killed every few seconds and Ray restarts
it: every request accounted for, nothing lost, every completed output equal to the same request's
output on the undisturbed deployment), then shutdown leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.reliability_bench import chaos, leftovers, soak, start

NAMESPACE = "duet_reliability_e2e"


@pytest.fixture(scope="module")
def deployment(ray_cluster, smollm2_path):
    d = start(2, namespace=NAMESPACE)
    yield d
    d.stop()


def test_soak_returns_every_kv_block_and_memory_stays_flat(deployment):
    report = asyncio.run(soak(deployment, seconds=20, rate=3.0, seed=2))
    print("soak:", report)
    assert report["sent"] >= 30 and report["statuses"] == {"OK": report["sent"]}
    assert report["kv_blocks_used_when_idle"] == 0
    for proc in ("router", "workers"):  # after warm-up, no steady growth (allocator noise is a few MB)
        rss = report["rss_mb"][proc]
        assert rss["last_mb"] - rss["first_mb"] < 64, (proc, rss)


def test_killing_workers_under_load_loses_nothing_and_changes_no_output(deployment):
    report = asyncio.run(chaos(deployment, seconds=24, kill_every=7, concurrency=3, seed=1, distinct_jobs=6))
    print("chaos:", {k: v for k, v in report.items() if k != "kills"})
    assert len(report["kills"]) >= 2 and report["sent"] >= 6
    assert report["lost"] == 0 and report["failed_other"] == {}, report
    assert report["mismatches"] == 0, report
    assert report["completed"] + report["failed_retryable"] == report["sent"]
    assert report["completed"] >= report["sent"] // 2
    # the kills hit requests in flight: they were retried or resumed, not failed
    assert report["retried"] + report["resumed"] >= 1, report


def test_shutdown_after_chaos_leaves_nothing_behind(deployment):
    pg = deployment.pool.placement_group
    deployment.stop()
    assert leftovers(NAMESPACE, pg) == {"actors": [], "placement_group": "REMOVED", "cpus_free": True}
