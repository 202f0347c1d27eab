"""What `duet bench` prints and draws: the rate table, the router-overhead lines, the PNG plot, and
the machine / code facts stored with each result.

The plot needs matplotlib (the ``bench`` extra: ``pip install 'duetserve[bench]'``); without it,
``plot`` returns False and the caller prints a one-line hint. Nothing here calls ``git``: a result
records the installed package's version (``importlib.metadata``), so it works from an installed
package as well as from a checkout.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

TARGET_TTFT_OVERHEAD_MS = 1.0
TARGET_PER_TOKEN_OVERHEAD_MS = 0.2
PLOT_HINT = "no PNG: matplotlib is not installed (pip install 'duetserve[bench]')"


def print_report(res: dict[str, Any]) -> None:
    print(f"\nduet bench: {res['config']['num_requests']} requests per rate, outputs "
          f"{res['config']['min_output']}-{res['config']['max_output']} tokens, SLO TTFT "
          f"{res['config']['slo_ttft_ms']} ms / TPOT {res['config']['slo_tpot_ms']} ms")
    head = (f"{'rate':>6} {'path':>7} {'ok':>5} {'TTFT p50/p90/p99 ms':>24} {'TPOT p50/p90/p99 ms':>22} "
            f"{'ITL p50/p99':>13} {'E2E p50 ms':>10} {'req/s':>6} {'tok/s':>7} {'goodput':>7}")
    print(head)
    for r in res.get("rates", []):
        t, p, i, e = r["ttft"], r["tpot"], r["itl"], r["e2e"]
        print(f"{r['rate']!s:>6} {r['path']:>7} {r['completed']:>2}/{r['num_requests']:<2} "
              f"{t['p50_ms']:>7.1f}/{t['p90_ms']:>7.1f}/{t['p99_ms']:>7.1f} "
              f"{p['p50_ms']:>6.2f}/{p['p90_ms']:>6.2f}/{p['p99_ms']:>6.2f} {i['p50_ms']:>6.1f}/{i['p99_ms']:<6.1f} "
              f"{e['p50_ms']:>10.1f} {r['request_throughput_rps']:>6.2f} {r['output_throughput_tps']:>7.1f} "
              f"{r['goodput_rps']:>7.2f}")
    hits = [r for r in res.get("rates", []) if "hit_rate" in r]
    if hits:
        print("\nprefix hit rate per KV tier (of prompt blocks; cluster/bench/tier_hits.py):")
        for r in hits:
            h = r["hit_rate"]
            print(f"{r['rate']!s:>6} {r['path']:>7}  device {h['device']:.2f}  host {h['host']:.2f}  "
                  f"disk (read back) {h['disk_read_back']:.2f}  of {h['prompt_blocks']} blocks")
    for key, title in (("overhead", "router overhead vs the real worker"),
                       ("overhead_echo", "router overhead vs a zero-compute echo worker")):
        if res.get(key):
            _print_overhead(title, res[key])


def _print_overhead(title: str, o: dict[str, Any]) -> None:
    print(f"\n{title} ({o['pairs']} closed-loop pairs, median of per-request differences):")
    print(f"  TTFT      {o['ttft_overhead_p50_ms']:+.3f} ms  (router {o['router_ttft_p50_ms']:.2f} vs direct "
          f"{o['direct_ttft_p50_ms']:.2f} ms; differences p25..p75 {o['ttft_overhead_p25_p75_ms'][0]:+.2f}.."
          f"{o['ttft_overhead_p25_p75_ms'][1]:+.2f})  target < {TARGET_TTFT_OVERHEAD_MS} ms: "
          f"{'yes' if o['ttft_target_met'] else 'NO'}")
    print(f"  per token {o['per_token_overhead_p50_ms']:+.3f} ms  (router {o['router_tpot_p50_ms']:.2f} vs direct "
          f"{o['direct_tpot_p50_ms']:.2f} ms; differences p25..p75 {o['per_token_overhead_p25_p75_ms'][0]:+.2f}.."
          f"{o['per_token_overhead_p25_p75_ms'][1]:+.2f})  target < {TARGET_PER_TOKEN_OVERHEAD_MS} ms: "
          f"{'yes' if o['per_token_target_met'] else 'NO'}")


def plot(res: dict[str, Any], path: Path) -> bool:
    """TTFT p50/p99, TPOT p50/p99 and throughput/goodput against the request rate, per path;
    False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = res.get("rates", [])
    paths = sorted({r["path"] for r in rates})
    finite = [r["rate"] for r in rates if r["rate"] != "inf"]
    inf_x = (max(finite) * 2) if finite else 1.0  # 'inf' drawn right of the largest finite rate

    def x(rate: Any) -> float:
        return inf_x if rate == "inf" else float(rate)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for path_name in paths:
        rs = sorted((r for r in rates if r["path"] == path_name), key=lambda r: x(r["rate"]))
        xs = [x(r["rate"]) for r in rs]
        for q, style in (("p50", "-o"), ("p99", "--x")):
            axes[0].plot(xs, [r["ttft"][f"{q}_ms"] for r in rs], style, label=f"{path_name} {q}")
            axes[1].plot(xs, [r["tpot"][f"{q}_ms"] for r in rs], style, label=f"{path_name} {q}")
        axes[2].plot(xs, [r["output_throughput_tps"] for r in rs], "-o", label=f"{path_name} output tok/s")
        axes[2].plot(xs, [r["goodput_rps"] * 100 for r in rs], "--x", label=f"{path_name} goodput x100 req/s")
    titles = ("TTFT (ms)", "TPOT (ms)", "throughput")
    ticks = sorted({x(r["rate"]) for r in rates})
    labels = ["inf" if t == inf_x and "inf" in [r["rate"] for r in rates] else f"{t:g}" for t in ticks]
    for ax, title in zip(axes, titles):
        ax.set_xticks(ticks, labels)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s; inf = all at once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"duet bench - {res['config']['model']} - duetserve {res['code'].get('version')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def code_version() -> dict[str, Any]:
    """The installed duetserve version (a checkout installed with ``pip install -e`` reports its own)."""
    try:
        version = metadata.version("duetserve")
    except metadata.PackageNotFoundError:
        version = None
    return {"package": "duetserve", "version": version}


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu_model": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()}
