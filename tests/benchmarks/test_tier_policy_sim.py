"""benchmarks/tier_policy_sim.py on a short trace: every (workload, host size, policy) row is there and
adds up; the host tier's policy never changes the device's hits (the device sees the same requests);
and LRU's host hits never fall as its tier grows (the device gives it the same stream of blocks
whatever its size, and LRU holds the stack property)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.tier_policy_sim import main
from testkit.tolerance import estimate


def test_rows_add_up_and_lru_grows_with_the_tier(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert main(["--requests", "400", "--device-blocks", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["workload"], r["host_ratio"], r["policy"]) for r in rows} == (
        {(w, 0.0, "-") for w in ("chat", "rag", "mixed")}
        | {(w, x, p) for w in ("chat", "rag", "mixed") for x in (0.5, 1.0, 2.0, 4.0) for p in ("lru", "arc")})
    for r in rows:
        assert r["device"] + r["host"] + r["computed"] == estimate(1.0, abs=1e-9, why="three shares of one count, "
                                                                                    "each rounded once")
        assert min(r["device"], r["host"], r["computed"]) >= 0
    for w in ("chat", "rag", "mixed"):
        mine = [r for r in rows if r["workload"] == w]
        assert len({r["device"] for r in mine}) == 1
        lru = [r["host"] for r in sorted((r for r in mine if r["policy"] == "lru"), key=lambda r: r["host_ratio"])]
        assert lru == sorted(lru) and lru[-1] > 0
