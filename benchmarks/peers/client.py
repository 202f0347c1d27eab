"""The load client for `make bench-peers`: AIPerf's command line, and its summary JSON parsed into a ``Point``.

Every server gets the same AIPerf run per concurrency: streaming ``/v1/completions``
(``--endpoint-type completions --streaming``), synthetic prompts of exactly ``input_tokens`` tokens
(stddev 0, SmolLM2's tokenizer from the model directory, offered to AIPerf as a Hub cache entry
by ``tokenizer_cache``), exactly ``output_tokens`` output tokens
(``max_tokens`` plus ``ignore_eos: true`` and ``min_tokens``, stddev 0), ``concurrency`` streams
kept busy for ``duration_s`` seconds after ``warmup`` requests, the same random seed for all, the
client pinned to its own core (``taskset -c <client_cores>``).

Figures (AIPerf's definitions; the summary file is ``profile_export_aiperf.json``):
    output tok/s   output tokens of completed requests / benchmark wall time
    TTFT           send -> first streamed token, ms (p50, p99 over requests)
    ITL            (E2E - TTFT) / (output tokens - 1) per request, ms (p50, p99)
    errors         requests that failed; ``resets``: those whose error names a reset or dropped
                   connection (the issue saw llama-server reset 5 of 64)

Example::

    hub_cache, repo = tokenizer_cache(model_dir, Path("/tmp/hf"))   # run AIPerf with HF_HUB_CACHE=hub_cache
    argv = aiperf_argv(Load(concurrency=8), aiperf=Path(".bench-envs/aiperf/bin/aiperf"),
                       url="http://127.0.0.1:8123", tokenizer=repo, artifacts=Path("/tmp/a"))
    point = parse_summary(json.loads((Path("/tmp/a") / SUMMARY_FILE).read_text()))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peers.servers import MODEL_ID

SUMMARY_FILE = "profile_export_aiperf.json"
RESET_WORDS = ("reset", "disconnect", "broken pipe", "connection closed", "connection refused",
               "server closed", "eof", "incomplete")


@dataclass(frozen=True)
class Load:
    """What the client sends at one point."""

    concurrency: int
    input_tokens: int = 128
    output_tokens: int = 64
    duration_s: float = 60.0
    warmup_requests: int = 0  # AIPerf's own warm-up (the harness warms each server up beforehand)
    seed: int = 29
    client_cores: str = "1"
    grace_s: float = 60.0  # how long AIPerf waits for requests in flight when the duration ends
    client_workers: int = 1


@dataclass
class Point:
    """One (server, concurrency) measurement."""

    server: str
    concurrency: int
    output_tok_s: float | None = None
    request_per_s: float | None = None
    requests: int = 0
    errors: int = 0
    resets: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    output_tokens_mean: float | None = None  # what the client counted per request (64 when ignore_eos worked)
    error_kinds: dict[str, int] = field(default_factory=dict)
    failure: str | None = None  # why the point has no figures (server crash, client failure)
    load: dict[str, Any] = field(default_factory=dict)  # loadavg and others' CPU share during the point
    wall_s: float | None = None

    def json(self) -> dict[str, Any]:
        return asdict(self)


TOKENIZER_REPO = "bench-peers/SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")


def tokenizer_cache(model_dir: Path, root: Path) -> tuple[Path, str]:
    """A Hugging Face Hub cache under ``root`` holding ``model_dir``'s tokenizer files (symlinks) as
    the snapshot of ``TOKENIZER_REPO``; returns (HF_HUB_CACHE, repo id).

    Why: offline (no hub is reachable), AIPerf 0.13 resolves every tokenizer name through
    ``snapshot_download(local_files_only=True)``, which rejects a plain directory path; online it
    would ask the hub. A cache entry is what its offline path can load."""
    entry = root / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snap = entry / "snapshots" / "local"
    snap.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text("local")
    for name in TOKENIZER_FILES:
        src, dst = model_dir / name, snap / name
        if src.is_file():
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            dst.symlink_to(src.resolve())
    return root, TOKENIZER_REPO


def aiperf_argv(load: Load, *, aiperf: Path, url: str, tokenizer: str, artifacts: Path) -> list[str]:
    """AIPerf's ``profile`` command for one point (see the module docstring)."""
    return [
        "taskset", "-c", load.client_cores, str(aiperf), "profile",
        "--model", MODEL_ID, "--url", url, "--endpoint-type", "completions", "--streaming",
        "--tokenizer", tokenizer,
        "--synthetic-input-tokens-mean", str(load.input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(load.output_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{load.output_tokens}",
        "--concurrency", str(load.concurrency),
        "--benchmark-duration", f"{load.duration_s:g}", "--benchmark-grace-period", f"{load.grace_s:g}",
        "--random-seed", str(load.seed), "--artifact-dir", str(artifacts),
        # One worker and one record processor: the client shares one core, and 64 streams of a
        # ~100 tok/s server are far from what one asyncio worker can drive.
        "--workers-max", str(load.client_workers), "--record-processors", "1",
        "--ui-type", "none",
    ] + (["--warmup-request-count", str(load.warmup_requests)] if load.warmup_requests else [])


def _stat(summary: dict[str, Any], metric: str, key: str) -> float | None:
    m = summary.get(metric)
    if not isinstance(m, dict):
        return None
    v = m.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _error_kinds(summary: dict[str, Any]) -> dict[str, int]:
    """AIPerf's ``error_summary`` (a list of {error_details: {type, code, message}, count}) as
    "type: message" -> count."""
    kinds: dict[str, int] = {}
    for item in summary.get("error_summary") or []:
        d = item.get("error_details") or {}
        label = ": ".join(str(x) for x in (d.get("type"), d.get("code"), d.get("message")) if x not in (None, ""))
        kinds[label or "unknown"] = kinds.get(label or "unknown", 0) + int(item.get("count", 0))
    return kinds


def parse_summary(summary: dict[str, Any], server: str, concurrency: int) -> Point:
    """A ``Point`` from AIPerf's summary JSON (``profile_export_aiperf.json``)."""
    kinds = _error_kinds(summary)
    errors = _stat(summary, "error_request_count", "avg")
    errors_n = int(errors) if errors is not None else sum(kinds.values())
    resets = sum(n for k, n in kinds.items() if any(w in k.lower() for w in RESET_WORDS))
    requests = _stat(summary, "request_count", "avg")
    return Point(
        server=server, concurrency=concurrency,
        output_tok_s=_stat(summary, "output_token_throughput", "avg"),
        request_per_s=_stat(summary, "request_throughput", "avg"),
        requests=int(requests) if requests is not None else 0,
        errors=errors_n, resets=resets,
        ttft_p50_ms=_stat(summary, "time_to_first_token", "p50"),
        ttft_p99_ms=_stat(summary, "time_to_first_token", "p99"),
        itl_p50_ms=_stat(summary, "inter_token_latency", "p50"),
        itl_p99_ms=_stat(summary, "inter_token_latency", "p99"),
        output_tokens_mean=_stat(summary, "output_sequence_length", "avg"),
        error_kinds=kinds,
    )
