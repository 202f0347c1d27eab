"""benchmarks/startup_bench.py: a replica's start-up by phase. The phases it reports for a start
sum to the wall time it measures independently (from launching the worker process to reading its
first token; only the pipe's latency is left over), they come in the worker's order, and a
standby's promotion reports only what promotion does (KV cache, warm-up, serving, first token)
after a load whose weights were mapped from the node's snapshot; a warm worker process (standby_load:
process) started at the script's go reports the whole load after it, with the weights mapped, and
its wall time is measured from the go. Every start serves the same greedy tokens."""

from __future__ import annotations

import argparse

from benchmarks.startup_bench import build_parser, run

ORDER = ["schedule", "resolve", "config", "kernels", "weights", "kv", "tokenizer", "warm_up", "serve", "first_token"]


def test_startup_phases_sum_to_the_wall_time(tmp_path):
    args: argparse.Namespace = build_parser().parse_args(
        ["--scenarios", "warm,standby,prestarted", "--repeats", "1", "--no-memory", "--kv-bytes", str(16 << 20),
         "--node-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out.json")])
    res = run(args)
    warm = res["runs"]["warm"][0]
    assert warm["order"] == ORDER
    assert all(d >= 0 for d in warm["phases"].values())
    assert 0 <= warm["unaccounted_s"] <= 0.25 + 0.02 * warm["wall_s"], warm  # the pipe, nothing else
    assert warm["notes"]["weights"] == "checkpoint"
    standby = res["runs"]["standby"][0]
    assert standby["order"] == ["kv", "serve", "first_token"]  # warmed up while it was a standby
    assert standby["wall_s"] == sum(standby["phases"].values())
    assert standby["prepare"]["notes"]["weights"] == "mapped"  # the snapshot the first load published
    assert list(standby["prepare"]["phases"]) == ["schedule", "resolve", "config", "kernels", "weights", "tokenizer",
                                                  "warm_up"]
    warm_process = res["runs"]["prestarted"][0]
    assert warm_process["order"] == ["config", "kernels", "weights", "kv", "warm_up", "serve", "first_token"]
    assert 0 <= warm_process["unaccounted_s"] <= 0.25 + 0.02 * warm_process["wall_s"], warm_process
    assert warm_process["notes"]["weights"] == "mapped"
    assert list(warm_process["prepare"]["phases"]) == ["schedule", "resolve", "config", "kernels", "tokenizer"]
    assert res["tokens_identical"] and len(warm["tokens"]) == 8
