"""`duet bench` end to end against a real router in front of one in-process fake worker: every phase
runs on both paths, the JSON holds consistent figures, and the PNG is written."""

from __future__ import annotations

import json

import pytest
from testkit.router_fakes import free_port, members

from cluster.bench import report
from cluster.bench.serving import main, parse_rates
from cluster.cli import main as duet_main
from router.config import RouterConfig
from router.server import serve_router


def test_bench_router_vs_direct_writes_json_and_png(smollm2_path, tok, pool, tmp_path, monkeypatch):
    for s in pool:
        s.worker.reset()
        s.worker.delay_s = 0.002
    config = RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=free_port(), max_model_len=512,
                          policy="round_robin", load_poll_interval_s=0.05)
    monkeypatch.chdir(tmp_path)  # no --out: results go under the current directory
    out = tmp_path / "duet-bench" / "serving_bench.json"
    with serve_router(config, members(pool[:1]), tokenizer=tok) as router:
        code = main(["--target", router.address, "--worker-endpoint", pool[0].endpoint, "--model", str(smollm2_path),
                     "--http-target", router.http_address, "--api-compare-requests", "3", "--n-trials", "1",
                     "--n-max-tokens", "4", "--n-prompt-tokens", "100",
                     "--rates", "40,inf", "--num-requests", "6", "--overhead-requests", "3", "--echo-overhead-requests", "4",
                     "--min-output", "3",
                     "--max-output", "8"])
    assert code == 0
    res = json.loads(out.read_text())
    assert res["code"]["package"] == "duetserve" and "commit" not in res["code"]  # no git: works when installed
    assert [(r["rate"], r["path"]) for r in res["rates"]] == [(40.0, "router"), (40.0, "direct"),
                                                             ("inf", "direct"), ("inf", "router")]
    for r in res["rates"]:
        assert r["completed"] == r["num_requests"] == 6 and not r["errors"]
        # the same requests on both paths: the same total output (max_tokens, fake worker honours it)
        assert r["output_tokens"] == res["rates"][0]["output_tokens"]
        assert 0 < r["ttft"]["p50_ms"] <= r["ttft"]["p99_ms"] and r["tpot"]["p50_ms"] > 0
        assert 0 < r["goodput_rps"] <= r["request_throughput_rps"]
        # hit rate per KV tier, from the worker's counters (the fake worker caches nothing: all 0)
        assert r["hit_rate"] == {"prompt_blocks": res["rates"][0]["hit_rate"]["prompt_blocks"], "device": 0.0,
                                 "host": 0.0, "disk_read_back": 0.0} and r["hit_rate"]["prompt_blocks"] > 0
    o = res["overhead"]
    assert o["pairs"] == 3 and len(o["raw"]["router"]) == len(o["raw"]["direct"]) == 3
    assert isinstance(o["ttft_overhead_p50_ms"], float) and isinstance(o["ttft_target_met"], bool)
    # 5 requests went through the router in the overhead phase (2 warm-up + 3) and 12 in the rate phase,
    # (2 + 3) * 2 in the api phase (each over gRPC and HTTP), 1 + (1 + 4) in the n phase (warm-up, one trial)
    assert len(pool[0].worker.submitted) == 2 * (5 + 12) + 10 + 6
    a = res["api_overhead"]
    assert a["pairs"] == 3 and not a["errors"] and isinstance(a["ttft_target_met"], bool)
    assert a["http_ttft_p50_ms"] > 0 and a["grpc_ttft_p50_ms"] > 0
    f = res["n_fanout"]
    assert f["trials"] == 1 and f["ratio"] > 0 and len(f["raw_ms"]["n4"]) == 1
    assert res["api_overhead_echo"]["pairs"] == 3  # HTTP vs gRPC against the echo worker as well (3 pairs)
    # the echo phase ran against its own zero-compute worker and router, not the fake pool
    e = res["overhead_echo"]
    assert e["pairs"] == 4 and e["echo_gap_ms"] > 0 and e["policy"] == "prefix_aware"
    router, direct = e["raw"]["router"], e["raw"]["direct"]
    assert len(router) == len(direct) == 4 and all(r["error"] is None for r in router + direct)
    # each pair is the same request: the same number of tokens through the router as straight from the worker
    assert [sum(r["chunk_tokens"]) for r in router] == [sum(d["chunk_tokens"]) for d in direct]
    assert 0 < e["direct_ttft_p50_ms"] and 0 < e["router_ttft_p50_ms"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_rates_are_rejected():
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, float("inf")]
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


def test_verbose_flag_before_bench_and_profile(capsys):
    for command in ("bench", "profile"):
        with pytest.raises(SystemExit) as exit_:
            duet_main(["-v", command, "--help"])
        assert exit_.value.code == 0
        assert f"duet {command}" in capsys.readouterr().out


def test_without_matplotlib_the_json_is_written_and_one_line_says_why_no_png(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert report.plot({"rates": [], "config": {"model": "m"}, "code": {}}, tmp_path / "x.png") is False
    assert not (tmp_path / "x.png").exists()
    assert report.PLOT_HINT.startswith("no PNG: matplotlib is not installed")


def test_bench_reaches_a_router_that_requires_a_token(smollm2_path, tok, pool, tmp_path):
    for s in pool:
        s.worker.reset()
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cr3t generate\n")
    config = RouterConfig(tokenizer_path=str(smollm2_path), port=0, http_port=0, max_model_len=512, policy="round_robin",
                          load_poll_interval_s=0.05, auth_tokens_file=str(tokens))
    args = ["--model", str(smollm2_path), "--rates", "inf", "--num-requests", "2", "--overhead-requests", "0",
            "--n-trials", "0",
            "--echo-overhead-requests", "0", "--min-output", "2", "--max-output", "3", "--no-plot"]
    with serve_router(config, members(pool[:1]), tokenizer=tok) as router:
        assert main(["--target", router.address, "--token", "s3cr3t", "--out", str(tmp_path / "ok.json"), *args]) == 0
        assert main(["--target", router.address, "--out", str(tmp_path / "denied.json"), *args]) == 0
    ok = json.loads((tmp_path / "ok.json").read_text())["rates"][0]
    denied = json.loads((tmp_path / "denied.json").read_text())["rates"][0]
    assert ok["completed"] == 2 and not ok["errors"]
    assert denied["completed"] == 0 and "UNAUTHENTICATED" in str(denied["errors"])
