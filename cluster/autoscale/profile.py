"""Capacity profiles: what one replica of a pool type sustains while meeting its SLOs.

A profile is measured once per (model, pool type, machine) by ``duet profile`` and read by the
autoscaler (cluster/autoscale/slo.py) and the simulator (cluster/sim/simulator.py). Terms:

    capacity        the highest Poisson arrival rate (requests/s) one replica served with its p90
                    TTFT and p90 TPOT within the SLOs, on the profile's request mix
    request mix     mean prompt and output tokens per request of the profiling load; the
                    autoscaler rescales capacity to the live mix through the token rates below
    prompt_tokens_per_s / output_tokens_per_s
                    capacity x mean prompt tokens, capacity x mean output tokens: the prefill and
                    decode work one replica does per second at capacity
    service model   optional fitted step times for the simulator: prefill of P tokens takes
                    ``prefill_base_s + prefill_per_token_s * P``; one decode step of a batch of B
                    sequences takes ``decode_base_s + decode_per_seq_s * B`` (continuous batching)

File format (JSON, one object; unknown keys are rejected so a typo is not silently ignored)::

    {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "colocated",
     "slo": {"ttft_p90_s": 0.5, "tpot_p90_s": 0.05},
     "capacity": {"requests_per_s": 1.6, "prompt_tokens_per_s": 72.0, "output_tokens_per_s": 102.4,
                  "mean_prompt_tokens": 45.0, "mean_output_tokens": 64.0},
     "service": {"prefill_base_s": 0.01, "prefill_per_token_s": 0.0004, "decode_base_s": 0.012,
                 "decode_per_seq_s": 0.002, "max_batch": 64},
     "machine": {"cpus": 2, "processor": "x86_64", "cpus_per_replica": 1},
     "measured": {"steps": [...]} }

Example::

    p = load_profile("profiles/smollm2-colocated.json")
    p.capacity.requests_per_s        # 1.6
    save_profile(p, "copy.json")
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FORMAT = "duet-profile/1"
POOL_TYPES = ("prefill", "decode", "colocated")


class ProfileError(ValueError):
    """A profile file is missing, malformed or inconsistent; the message names the key and the fix."""


@dataclass(frozen=True)
class SLOTargets:
    """p90 latency targets in seconds; None = not constrained (a prefill pool has no TPOT target)."""

    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None


@dataclass(frozen=True)
class ReplicaCapacity:
    """One replica's throughput at the SLOs (see the module docstring for each field)."""

    requests_per_s: float
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.requests_per_s * self.mean_prompt_tokens

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests_per_s * self.mean_output_tokens


@dataclass(frozen=True)
class ServiceModel:
    """Fitted step times of one replica (seconds); see the module docstring."""

    prefill_base_s: float
    prefill_per_token_s: float
    decode_base_s: float
    decode_per_seq_s: float
    max_batch: int = 64

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * prompt_tokens

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch


@dataclass(frozen=True)
class Profile:
    model: str
    pool_type: str
    slo: SLOTargets
    capacity: ReplicaCapacity
    service: ServiceModel | None = None
    machine: dict[str, Any] = field(default_factory=dict, hash=False)
    measured: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        validate_profile(self)


def validate_profile(p: Profile, where: str = "profile") -> None:
    """Raise ProfileError naming the first bad key."""
    def need(ok: bool, key: str, value: Any, fix: str) -> None:
        if not ok:
            raise ProfileError(f"{where}: {key}={value!r}: {fix}")

    need(bool(p.model), "model", p.model, "must name the model the profile was measured with")
    need(p.pool_type in POOL_TYPES, "pool_type", p.pool_type, f"must be one of {', '.join(POOL_TYPES)}")
    for key in ("ttft_p90_s", "tpot_p90_s"):
        v = getattr(p.slo, key)
        need(v is None or (_finite(v) and v > 0), f"slo.{key}", v, "must be a number of seconds > 0, or null")
    need(p.pool_type == "decode" or p.slo.ttft_p90_s is not None, "slo.ttft_p90_s", None,
         f"a {p.pool_type} profile needs a TTFT target")
    need(p.pool_type == "prefill" or p.slo.tpot_p90_s is not None, "slo.tpot_p90_s", None,
         f"a {p.pool_type} profile needs a TPOT target")
    c = p.capacity
    need(_finite(c.requests_per_s) and c.requests_per_s > 0, "capacity.requests_per_s", c.requests_per_s,
         "must be > 0 (a replica that meets the SLOs at no load is misconfigured: relax the SLOs)")
    for key in ("mean_prompt_tokens", "mean_output_tokens"):
        v = getattr(c, key)
        need(_finite(v) and v >= 0, f"capacity.{key}", v, "must be a number >= 0 (0 = unknown)")
    if p.service is not None:
        s = p.service
        for key in ("prefill_base_s", "prefill_per_token_s", "decode_base_s", "decode_per_seq_s"):
            v = getattr(s, key)
            need(_finite(v) and v >= 0, f"service.{key}", v, "must be a number of seconds >= 0")
        need(s.decode_base_s + s.decode_per_seq_s > 0, "service.decode_base_s", s.decode_base_s,
             "decode steps cannot take no time: fit decode_base_s / decode_per_seq_s > 0")
        need(isinstance(s.max_batch, int) and s.max_batch >= 1, "service.max_batch", s.max_batch, "must be an integer >= 1")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def profile_to_dict(p: Profile) -> dict[str, Any]:
    d = asdict(p)
    d["capacity"]["prompt_tokens_per_s"] = p.capacity.prompt_tokens_per_s
    d["capacity"]["output_tokens_per_s"] = p.capacity.output_tokens_per_s
    return {"format": FORMAT, **d}


def profile_from_dict(d: Any, where: str = "profile") -> Profile:
    """Build and validate a Profile from parsed JSON; ProfileError names a missing/unknown key."""
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: must be a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise ProfileError(f"{where}: format={d.get('format')!r}: expected {FORMAT!r} (re-run `duet profile`)")

    def section(key: str, cls: type[DataclassInstance], derived: tuple[str, ...] = ()) -> Any:
        raw = d.get(key)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: {key} must be an object, got {raw!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names - set(derived))
        if unknown:
            raise ProfileError(f"{where}: {key} has unknown keys {unknown}; valid: {sorted(names)}")
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except TypeError as e:
            raise ProfileError(f"{where}: {key}: {e}") from None

    unknown = sorted(set(d) - {"format", "model", "pool_type", "slo", "capacity", "service", "machine", "measured"})
    if unknown:
        raise ProfileError(f"{where}: unknown keys {unknown}")
    for key in ("model", "pool_type", "slo", "capacity"):
        if key not in d:
            raise ProfileError(f"{where}: missing key {key!r}")
    try:
        return Profile(model=d["model"], pool_type=d["pool_type"], slo=section("slo", SLOTargets),
                       capacity=section("capacity", ReplicaCapacity, ("prompt_tokens_per_s", "output_tokens_per_s")),
                       service=section("service", ServiceModel), machine=dict(d.get("machine") or {}),
                       measured=dict(d.get("measured") or {}))
    except ProfileError as e:
        raise ProfileError(str(e).replace("profile:", f"{where}:", 1)) from None


def load_profile(path: str | os.PathLike[str]) -> Profile:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile; measure one with `duet profile --out {path}`") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return profile_from_dict(d, str(path))


def save_profile(p: Profile, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile_to_dict(p), indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a profile
    return path
