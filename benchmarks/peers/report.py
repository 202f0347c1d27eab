"""Tables, JSON and the plot of `make bench-peers`.

``main_table`` is the issue's table: one row per server with how it ran, one column per
concurrency, each cell "output tok/s (ITL p50 ms)", with the failed / reset connections after a
semicolon when there were any. ``latency_table`` gives TTFT p50/p99, ITL p99, the server's CPU per
output token and the load per point.
``verdict`` compares Duet's best dtype with the best peer at each concurrency (the issue's target:
>= 1.2x the tokens/s with p50 ITL no worse).

Example row::

    | llamacpp-q4_1 (1 thread (core 0), 64 slots x 256 ctx, Q4_1 GGUF, ...) | 48.9 (12 ms) | 66.0 (76 ms; 5 of 64 failed, 5 reset) |
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.2


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def short_failure(msg: str) -> str:
    """A table-sized reason for a point without figures (the JSON keeps the whole message)."""
    if m := re.search(r"completed=(\d+), cancelled=(\d+)", msg):
        return f"failed: {m[1]} requests done, {m[2]} cancelled after the grace period"
    if msg.startswith("start or warm-up failed"):
        return "failed: did not start (see the JSON)"
    if "server died" in msg or "server exited" in msg:
        return "failed: the server died (see the JSON)"
    return "failed (see the JSON)"


def cell(p: dict[str, Any]) -> str:
    """"52.8 (15 ms)"; "failed: <why>" when the point has no figures."""
    if p.get("failure"):
        return short_failure(p["failure"])
    text = f"{_fmt(p.get('output_tok_s'))} ({_fmt(p.get('itl_p50_ms'), 0)} ms"
    if p.get("errors"):
        text += f"; {p['errors']} of {p['errors'] + p.get('requests', 0)} failed"
        if p.get("resets"):
            text += f", {p['resets']} reset"
    return text + ")"


def points_by(result: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """server -> concurrency -> point."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for p in result["points"]:
        out.setdefault(p["server"], {})[int(p["concurrency"])] = p
    return out


def concurrencies(result: dict[str, Any]) -> list[int]:
    return sorted({int(p["concurrency"]) for p in result["points"]})


def main_table(result: dict[str, Any]) -> str:
    by, cs = points_by(result), concurrencies(result)
    how = result.get("how", {})
    lines = ["| output tokens/s (ITL p50) | " + " | ".join(f"{c} stream{'s' if c > 1 else ''}" for c in cs) + " |",
             "|---|" + "---|" * len(cs)]
    for server in result.get("servers", list(by)):
        if server not in by:
            continue
        label = f"{server} ({how[server]})" if server in how else server
        lines.append(f"| {label} | " + " | ".join(cell(by[server][c]) if c in by[server] else "-" for c in cs) + " |")
    for server, why in result.get("skipped", {}).items():
        lines.append(f"| {server} | not run: {why} |" + " |" * (len(cs) - 1))
    return "\n".join(lines)


def cpu_ms_per_token(p: dict[str, Any]) -> float | None:
    """CPU the server's whole process tree used during the point (client start-up and drain included)
    per output token the client received: what a token costs the server, far less sensitive than
    tokens/s to how much of its core others took."""
    tokens = (p.get("output_tokens_mean") or 0) * p.get("requests", 0)
    cpu = p.get("load", {}).get("server_cpu_s")
    return None if not tokens or cpu is None else 1000.0 * cpu / tokens


def latency_table(result: dict[str, Any]) -> str:
    by, cs = points_by(result), concurrencies(result)
    lines = ["| server | streams | TTFT p50 / p99 ms | ITL p50 / p99 ms | requests | failed (reset) | server CPU ms / output token | load 1-min avg | others' CPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for server in result.get("servers", list(by)):
        for c in cs:
            p = by.get(server, {}).get(c)
            if p is None:
                continue
            load = p.get("load", {})
            lines.append(
                f"| {server} | {c} | {_fmt(p.get('ttft_p50_ms'), 0)} / {_fmt(p.get('ttft_p99_ms'), 0)} | "
                f"{_fmt(p.get('itl_p50_ms'), 0)} / {_fmt(p.get('itl_p99_ms'), 0)} | {p.get('requests', 0)} | "
                f"{p.get('errors', 0)} ({p.get('resets', 0)}) | {_fmt(cpu_ms_per_token(p), 1)} | "
                f"{_fmt(load.get('loadavg_1m_start'))}-{_fmt(load.get('loadavg_1m_end'))} | "
                f"{_fmt(load.get('others_cores'), 2)} cores |")
    return "\n".join(lines)


def verdict(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per concurrency: Duet's best server, the best peer, their tok/s ratio and p50 ITLs, and
    whether the issue's target (>= 1.2x, ITL no worse) is met. Points without figures are left out."""
    by, rows = points_by(result), []
    for c in concurrencies(result):
        def best(prefix: str) -> tuple[str, dict[str, Any]] | None:
            got = [(s, ps[c]) for s, ps in by.items()  # noqa: B023 - called in this iteration
                   if (s.startswith("duet-") == (prefix == "duet")) and c in ps and ps[c].get("output_tok_s")]  # noqa: B023 - called in this iteration
            return max(got, key=lambda sp: sp[1]["output_tok_s"], default=None)
        duet, peer = best("duet"), best("peer")
        if duet is None or peer is None:
            continue
        ratio = duet[1]["output_tok_s"] / peer[1]["output_tok_s"]
        d_itl, p_itl = duet[1].get("itl_p50_ms"), peer[1].get("itl_p50_ms")
        itl_ok = d_itl is not None and p_itl is not None and d_itl <= p_itl
        rows.append({"concurrency": c, "duet": duet[0], "peer": peer[0], "ratio": ratio,
                     "duet_itl_p50_ms": d_itl, "peer_itl_p50_ms": p_itl,
                     "met": ratio >= TARGET_RATIO and itl_ok})
    return rows


def verdict_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| streams | Duet's best | best peer | tok/s ratio (target >= 1.2x) | ITL p50 Duet / peer ms | target |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['duet']} | {r['peer']} | {r['ratio']:.2f}x | "
                     f"{_fmt(r['duet_itl_p50_ms'], 0)} / {_fmt(r['peer_itl_p50_ms'], 0)} | {'met' if r['met'] else 'missed'} |")
    return "\n".join(lines)


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the points of ``old`` it did not re-measure (to rerun noisy points only);
    servers keep old's order, new ones appended."""
    fresh = {(p["server"], int(p["concurrency"])) for p in new["points"]}
    kept = [p for p in old.get("points", []) if (p["server"], int(p["concurrency"])) not in fresh]
    out = dict(new)
    out["points"] = kept + new["points"]
    out["servers"] = list(dict.fromkeys([*old.get("servers", []), *new.get("servers", [])]))
    out["how"] = {**old.get("how", {}), **new.get("how", {})}
    skipped = {**old.get("skipped", {}), **new.get("skipped", {})}
    out["skipped"] = {s: why for s, why in skipped.items() if s not in {p["server"] for p in out["points"]}}
    out["runs"] = [*old.get("runs", [old.get("run", {})]), new.get("run", {})]
    return out


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")


def write_plot(result: dict[str, Any], path: Path) -> str | None:
    """Output tok/s and p50 ITL vs concurrency per server (PNG); returns why not when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    by = points_by(result)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for server in result.get("servers", list(by)):
        pts = sorted((c, p) for c, p in by.get(server, {}).items() if p.get("output_tok_s"))
        if not pts:
            continue
        style = "-o" if server.startswith("duet-") else "--s"
        ax1.plot([c for c, _ in pts], [p["output_tok_s"] for _, p in pts], style, label=server)
        ax2.plot([c for c, _ in pts], [p.get("itl_p50_ms") for _, p in pts], style, label=server)
    for ax, title, unit in ((ax1, "output tokens/s", "tok/s"), (ax2, "ITL p50", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    run = result.get("run", {})
    fig.suptitle(f"SmolLM2-135M, {run.get('threads', '?')} thread per server, {run.get('cpu_model', '')} "
                 f"({run.get('date', '')})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
