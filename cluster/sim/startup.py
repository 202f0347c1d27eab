"""Replica start-up times for the simulator, from measurements: how long a new replica takes from
the scale-up decision to its first served token, per model and device.

Terms:
    cold_s     a replica whose node has not loaded the model: weights read from disk
    shared_s   a replica on a node that holds the weights already (the node's shared snapshot,
               workers/models/shared_weights.py): mapped instead of read
    standby_s  a standby replica promoted (loaded, unrouted; cluster/deploy/controller.py)
    prestarted_s  a warm worker process promoted (a standby with ``standby_load: process``: imports,
               config, tokenizer and kernels done, no weights; it maps the node's snapshot), where
               measured; a pool whose standbys are warm processes promotes them in this time

A profile file (JSON) maps ``<model>@<device>`` to those three figures plus where they come from;
benchmarks/startup_bench.py writes one from its medians (``--profile-out``: the cluster path's,
which include Ray's scheduling and the controller's and router's registration, where it ran),
and cluster/sim/data/startup_profiles.json holds the ones measured for this repository
(benchmarks/README.md says when and under what load).

Example::

    s = load_startup(DEFAULT_PROFILES, "SmolLM2-135M-Instruct@cpu")
    SimPool("decode", "decode", svc, startup_s=s.cold_s, standby_s=s.standby_s)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROFILES = Path(__file__).resolve().parent / "data" / "startup_profiles.json"
DEFAULT_KEY = "SmolLM2-135M-Instruct@cpu"


class StartupProfileError(ValueError):
    """A startup profile file or entry that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class StartupModel:
    """Seconds from a scale-up decision to a new replica's first served token (module docstring)."""

    cold_s: float
    shared_s: float
    standby_s: float
    source: str = ""
    prestarted_s: float | None = None

    def __post_init__(self) -> None:
        for key in ("cold_s", "shared_s", "standby_s", "prestarted_s"):
            v = getattr(self, key)
            if key == "prestarted_s" and v is None:
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise StartupProfileError(f"{key}={v!r}: must be a number of seconds >= 0")

    def new_replica_s(self, kind: str) -> float:
        """A new (not standby) replica's start-up: 'cold' or 'shared'."""
        if kind not in ("cold", "shared"):
            raise StartupProfileError(f"start-up kind {kind!r}: must be cold or shared")
        return self.cold_s if kind == "cold" else self.shared_s

    def promoted_s(self, standby_load: str) -> float:
        """A standby's promotion: 'model' (loaded, unrouted) or 'process' (a warm worker process)."""
        if standby_load == "model":
            return self.standby_s
        if standby_load != "process":
            raise StartupProfileError(f"standby load {standby_load!r}: must be model or process")
        if self.prestarted_s is None:
            raise StartupProfileError("this start-up profile entry has no prestarted_s (a warm process's promotion): "
                                      "measure it with `python -m benchmarks.startup_bench --cluster --profile-out FILE`")
        return self.prestarted_s


def load_startup(path: Path, key: str) -> StartupModel:
    """The entry ``key`` (``<model>@<device>``) of the profile file at ``path``."""
    try:
        profiles = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise StartupProfileError(f"startup profile {str(path)!r}: unreadable ({e}); write one with "
                                  "`python -m benchmarks.startup_bench --profile-out FILE`") from None
    entry = profiles.get(key) if isinstance(profiles, dict) else None
    if not isinstance(entry, dict):
        known = ", ".join(sorted(profiles)) if isinstance(profiles, dict) else "none"
        raise StartupProfileError(f"startup profile {str(path)!r} has no entry {key!r} (it has: {known})")
    try:
        pre = entry.get("prestarted_s")
        return StartupModel(float(entry["cold_s"]), float(entry["shared_s"]), float(entry["standby_s"]),
                            str(entry.get("source", "")), None if pre is None else float(pre))
    except (KeyError, TypeError, ValueError) as e:
        raise StartupProfileError(f"startup profile {str(path)!r} entry {key!r}: {e}") from None


def save_startup(path: Path, key: str, model: StartupModel, extra: dict[str, Any] | None = None) -> None:
    """Add or replace ``key`` in the profile file at ``path`` (created if missing)."""
    try:
        profiles = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        profiles = {}
    profiles[key] = {**asdict(model), **(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profiles, indent=1, sort_keys=True) + "\n")
