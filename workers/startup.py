"""The start-up timeline of one replica: when each phase of bringing it up ended.

A replica is ready in a fixed sequence of phases; each one *ends* with a mark, and a phase's
duration is the time from the previous mark (or the timeline's origin) to its own. The durations
therefore sum to the time from the origin to the last mark exactly, glue code included (it counts
in the phase it precedes). Phases, in the order a worker runs them (a phase that does not run has
no mark):

    wake         (cluster side) a request held by the router until the controller decided to
                 wake its pool from zero (the origin is then the request's arrival)
    schedule     (cluster side) placement, the worker process's start and imports, up to the
                 actor's ``__init__``; the origin is the scale-up decision
    resolve      the model name resolved to a checkpoint directory (prepared once per node)
    config       the model's config read (its first use imports transformers, seconds on a busy host,
                 unless the node recorded the spec: workers/models/spec_record.py)
    kernels      the C++ CPU kernels loaded (built on a cache miss; kernels/_build.py)
    weights      the model built and its weights read: from disk or the page cache, or mapped from
                 the node's shared snapshot (workers/models/shared_weights.py); ``notes['weights']``
                 says which
    kv           the KV cache allocated
    tokenizer    the tokenizer loaded
    cuda_graphs  decode CUDA graphs captured (device cuda with cuda_graphs on only)
    warm_up      one short request through prefill, decode and sampling
    serve        the gRPC server listening
    register     (cluster side) the controller saw the replica serving and the router listed it
    first_token  (cluster side) the first token of the first request routed to it

The clock is ``time.monotonic()``: CLOCK_MONOTONIC on Linux, one clock for every process of a host,
so a timeline started by the controller can be continued by the worker actor on the same node.

Example::

    t = StartupTimeline.start()
    load(); t.mark("weights", note="page cache")
    t.phases()          # [("weights", 2.91)]; sum(d for _, d in t.phases()) == t.elapsed_s
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PHASES = ("wake", "schedule", "resolve", "config", "kernels", "weights", "kv", "tokenizer", "cuda_graphs", "warm_up", "serve",
          "register", "first_token")


@dataclass
class StartupTimeline:
    """``origin`` and the marks (phase, monotonic time at its end), in the order they were made."""

    origin: float
    marks: list[tuple[str, float]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, origin: float | None = None) -> StartupTimeline:
        return cls(time.monotonic() if origin is None else origin)

    def mark(self, phase: str, *, note: str | None = None, at: float | None = None) -> None:
        """``phase`` ended now (or at ``at``); marks are in time order and each phase is marked once."""
        assert phase in PHASES, f"unknown start-up phase {phase!r}; one of {PHASES}"
        assert all(p != phase for p, _ in self.marks), f"start-up phase {phase!r} marked twice"
        t = time.monotonic() if at is None else at
        assert t >= self.end, f"start-up phase {phase!r} ends at {t} before the previous mark ({self.end})"
        self.marks.append((phase, t))
        if note is not None:
            self.notes[phase] = note

    @property
    def end(self) -> float:
        return self.marks[-1][1] if self.marks else self.origin

    @property
    def elapsed_s(self) -> float:
        return self.end - self.origin

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds) in order; they sum to ``elapsed_s``."""
        out, last = [], self.origin
        for phase, t in self.marks:
            out.append((phase, t - last))
            last = t
        return out

    def extend(self, other: StartupTimeline) -> None:
        """Append ``other``'s marks (a later part of the same start, e.g. the worker's, continuing the
        controller's): they must all come after this timeline's last mark."""
        for phase, t in other.marks:
            self.mark(phase, note=other.notes.get(phase), at=t)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (it crosses Ray and goes into benchmark JSON)."""
        return {"origin": self.origin, "marks": [list(m) for m in self.marks], "notes": dict(self.notes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StartupTimeline:
        return cls(float(d["origin"]), [(str(p), float(t)) for p, t in d["marks"]], dict(d.get("notes", {})))
