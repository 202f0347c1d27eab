"""Chaos on a local Ray deployment (benchmarks/reliability_bench.py's chaos phase, shortened): two
workers, a closed loop of clients sending greedy requests while a random worker is killed every
few seconds (Ray restarts it). Every request must be accounted for (nothing lost), and every
completed output must equal the same request's output on the undisturbed deployment."""

from __future__ import annotations

import asyncio

from benchmarks.reliability_bench import chaos, leftovers, start

NAMESPACE = "duet_chaos_e2e"


def test_killing_workers_under_load_loses_nothing_and_changes_no_output(ray_cluster, smollm2_path):
    d = start(2, namespace=NAMESPACE)
    try:
        report = asyncio.run(chaos(d, seconds=24, kill_every=7, concurrency=3, seed=1, distinct_jobs=6))
    finally:
        pg = d.pool.placement_group
        d.stop()
    print("chaos:", {k: v for k, v in report.items() if k != "kills"})
    assert len(report["kills"]) >= 2 and report["sent"] >= 6
    assert report["lost"] == 0 and report["failed_other"] == {}, report
    assert report["mismatches"] == 0, report
    assert report["completed"] + report["failed_retryable"] == report["sent"]
    assert report["completed"] >= report["sent"] // 2
    # the kills hit requests in flight: some were retried or resumed rather than failed
    assert report["retried"] + report["resumed"] >= 1, report
    gone = leftovers(NAMESPACE, pg)
    assert gone == {"actors": [], "placement_group": "REMOVED"}
