"""`make bench-peers` without the peers: AIPerf's command line and its summary parsed
(benchmarks/peers/client.py, on a summary AIPerf 0.13 wrote in a real run against Duet q4), and the
tables, verdict, merge, JSON and plot (benchmarks/peers/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peers import report
from benchmarks.peers.client import TOKENIZER_REPO, Load, Point, aiperf_argv, parse_summary, tokenizer_cache

DATA = Path(__file__).parent / "data"


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_aiperf_argv_sends_the_issue_s_load():
    argv = aiperf_argv(Load(concurrency=32, duration_s=75), aiperf=Path("/envs/aiperf/bin/aiperf"),
                       url="http://127.0.0.1:8123", tokenizer=TOKENIZER_REPO, artifacts=Path("/tmp/a"))
    assert argv[:4] == ["taskset", "-c", "1", "/envs/aiperf/bin/aiperf"] and argv[4] == "profile"
    assert _flag(argv, "--endpoint-type") == ["completions"] and "--streaming" in argv
    assert _flag(argv, "--synthetic-input-tokens-mean") == ["128"] and _flag(argv, "--synthetic-input-tokens-stddev") == ["0"]
    assert _flag(argv, "--output-tokens-mean") == ["64"] and _flag(argv, "--output-tokens-stddev") == ["0"]
    assert _flag(argv, "--extra-inputs") == ["ignore_eos:true", "min_tokens:64"]
    assert _flag(argv, "--concurrency") == ["32"] and _flag(argv, "--benchmark-duration") == ["75"]
    assert _flag(argv, "--url") == ["http://127.0.0.1:8123"] and _flag(argv, "--model") == ["SmolLM2-135M-Instruct"]
    assert "--warmup-request-count" not in argv  # the harness warms each server up itself
    assert _flag(aiperf_argv(Load(concurrency=1, warmup_requests=3), aiperf=Path("a"), url="u", tokenizer="t",
                             artifacts=Path("d")), "--warmup-request-count") == ["3"]


def test_tokenizer_cache_is_a_hub_snapshot_of_the_model_dir(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text("{}")
    (model / "model.safetensors").write_text("weights")
    root, repo = tokenizer_cache(model, tmp_path / "hf")
    entry = root / ("models--" + repo.replace("/", "--"))
    rev = (entry / "refs" / "main").read_text()
    snap = entry / "snapshots" / rev
    assert (snap / "tokenizer.json").resolve() == (model / "tokenizer.json").resolve()
    assert not (snap / "model.safetensors").exists()  # the tokenizer only
    assert tokenizer_cache(model, tmp_path / "hf") == (root, repo)  # a second call is harmless


def test_parse_a_real_aiperf_summary():
    summary = json.loads((DATA / "aiperf_summary_duet_q4_c8.json").read_text())
    p = parse_summary(summary, "duet-q4", 8)
    assert p.server == "duet-q4" and p.concurrency == 8
    assert p.output_tok_s == summary["output_token_throughput"]["avg"]
    assert p.ttft_p50_ms == summary["time_to_first_token"]["p50"] and p.ttft_p99_ms == summary["time_to_first_token"]["p99"]
    assert p.itl_p50_ms == summary["inter_token_latency"]["p50"] and p.itl_p99_ms == summary["inter_token_latency"]["p99"]
    assert p.requests == 8 and p.errors == 0 and p.resets == 0 and p.failure is None
    assert p.output_tokens_mean == summary["output_sequence_length"]["avg"]


def test_errors_and_resets_are_counted_from_the_error_summary():
    summary = json.loads((DATA / "aiperf_summary_duet_q4_c8.json").read_text())
    summary["error_request_count"] = {"unit": "requests", "avg": 7.0}
    summary["error_summary"] = [
        {"error_details": {"type": "ClientConnectionResetError", "message": "Connection reset by peer"}, "count": 5},
        {"error_details": {"type": "ServerDisconnectedError", "message": "Server disconnected"}, "count": 1},
        {"error_details": {"code": 500, "type": "HTTPError", "message": "internal"}, "count": 1},
    ]
    p = parse_summary(summary, "llamacpp-q4_1", 32)
    assert p.errors == 7 and p.resets == 6
    assert p.error_kinds["HTTPError: 500: internal"] == 1
    # Without error_request_count the kinds are summed.
    del summary["error_request_count"]
    assert parse_summary(summary, "llamacpp-q4_1", 32).errors == 7


def _result() -> dict:
    def pt(server: str, c: int, tok: float, itl: float, **kw) -> dict:
        return Point(server, c, output_tok_s=tok, itl_p50_ms=itl, requests=64, **kw).json()
    return {"run": {"date": "2026-11-28 14:00", "threads": 1, "cpu_model": "test CPU"},
            "servers": ["duet-fp32", "duet-q4", "vllm-bf16", "llamacpp-q4_1"],
            "how": {"duet-q4": "1 thread (core 0), q4", "vllm-bf16": "1 thread (core 0), bfloat16"},
            "skipped": {"vllm-fp32": "no venv"},
            "points": [pt("duet-fp32", 1, 30.0, 29.0), pt("duet-q4", 1, 60.0, 15.0), pt("vllm-bf16", 1, 25.0, 32.0),
                       pt("llamacpp-q4_1", 1, 48.0, 12.0),
                       pt("duet-fp32", 32, 91.0, 306.0), pt("duet-q4", 32, 100.0, 261.0),
                       pt("vllm-bf16", 32, 178.0, 124.0), pt("llamacpp-q4_1", 32, 64.0, 259.0, errors=5, resets=5)]}


def test_main_table_has_a_cell_per_point_and_says_how_each_server_ran():
    table = report.main_table(_result())
    lines = table.splitlines()
    assert lines[0] == "| output tokens/s (ITL p50) | 1 stream | 32 streams |"
    assert "| duet-q4 (1 thread (core 0), q4) | 60.0 (15 ms) | 100.0 (261 ms) |" in lines
    assert "| llamacpp-q4_1 | 48.0 (12 ms) | 64.0 (259 ms; 5 of 69 failed, 5 reset) |" in lines
    assert any(ln.startswith("| vllm-fp32 | not run: no venv") for ln in lines)
    assert "| duet-q4 | 32 |" in report.latency_table(_result())


def test_cpu_per_token_is_the_server_tree_s_cpu_over_the_tokens_received():
    p = Point("duet-q4", 8, output_tok_s=10.0, requests=16, output_tokens_mean=64.0,
              load={"server_cpu_s": 20.48}).json()
    assert report.cpu_ms_per_token(p) == 1000.0 * 20.48 / (16 * 64.0)
    assert report.cpu_ms_per_token(Point("duet-q4", 8).json()) is None  # no tokens, no figure


def test_a_failed_point_says_why():
    def cell(msg: str) -> str:
        return report.cell(Point("vllm-bf16", 8, failure=msg).json())
    assert cell("start or warm-up failed: exited with 1") == "failed: did not start (see the JSON)"
    assert cell("aiperf wrote no profile_export_aiperf.json (rc 1; log x): completed=0, cancelled=64, errors=0 "
                "| sessions") == "failed: 0 requests done, 64 cancelled after the grace period"
    assert cell("server died during the point; log tail: ...") == "failed: the server died (see the JSON)"


def test_verdict_compares_duet_s_best_with_the_best_peer():
    rows = {r["concurrency"]: r for r in report.verdict(_result())}
    assert rows[1]["duet"] == "duet-q4" and rows[1]["peer"] == "llamacpp-q4_1"
    assert rows[1]["ratio"] == 60.0 / 48.0 and rows[1]["met"] is False  # 1.25x, but ITL 15 ms > 12 ms
    assert rows[32]["duet"] == "duet-q4" and rows[32]["peer"] == "vllm-bf16"
    assert rows[32]["ratio"] == 100.0 / 178.0 and rows[32]["met"] is False
    result = _result()
    result["points"][3]["itl_p50_ms"] = 16.0
    assert {r["concurrency"]: r for r in report.verdict(result)}[1]["met"] is True
    assert "| 1 | duet-q4 | llamacpp-q4_1 | 1.25x | 15 / 12 | missed |" in report.verdict_table(report.verdict(_result()))


def test_merge_keeps_the_points_a_rerun_did_not_measure():
    old = _result()
    new = {"run": {"date": "later"}, "servers": ["vllm-bf16", "vllm-fp32"], "how": {"vllm-fp32": "fp32"},
           "skipped": {}, "points": [Point("vllm-bf16", 32, output_tok_s=150.0, itl_p50_ms=130.0).json(),
                                     Point("vllm-fp32", 1, output_tok_s=16.0, itl_p50_ms=53.0).json()]}
    merged = report.merge(old, new)
    by = report.points_by(merged)
    assert by["vllm-bf16"][32]["output_tok_s"] == 150.0 and by["vllm-bf16"][1]["output_tok_s"] == 25.0
    assert by["duet-q4"][1]["output_tok_s"] == 60.0 and "vllm-fp32" in by
    assert merged["skipped"] == {}  # vllm-fp32 ran this time
    assert merged["servers"] == ["duet-fp32", "duet-q4", "vllm-bf16", "llamacpp-q4_1", "vllm-fp32"]
    assert len(merged["points"]) == len(old["points"]) + 1
    assert [r.get("date") for r in merged["runs"]] == ["2026-11-28 14:00", "later"]


def test_json_and_plot_are_written(tmp_path: Path):
    result = _result()
    result["verdict"] = report.verdict(result)
    report.write_json(result, tmp_path / "out" / "bench_peers.json")
    assert json.loads((tmp_path / "out" / "bench_peers.json").read_text()) == result
    assert report.write_plot(result, tmp_path / "out" / "bench_peers.png") is None
    assert (tmp_path / "out" / "bench_peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_flag_prints_the_tables_of_a_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from benchmarks.peers.run import main

    result = _result()
    result["run"].update(server_cores="0", client_cores="1", commit="abc1234")
    report.write_json(result, tmp_path / "r.json")
    assert main(["--report", "--out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "| duet-q4 (1 thread (core 0), q4) | 60.0 (15 ms) | 100.0 (261 ms) |" in out
    assert "| 32 | duet-q4 | vllm-bf16 | 0.56x |" in out and (tmp_path / "r.png").exists()
