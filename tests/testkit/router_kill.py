"""Streams cut by a router's death and resumed through the Duet client (router/client.py), for the
tests that kill a router mid-stream (tests/router/test_client_resume.py in one process,
tests/e2e/test_routers_e2e.py through ``duet serve``) or SIGTERM one (tests/e2e/test_split_router_e2e.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.client import collect, complete, stream

Case = tuple[str, dict[str, Any]]  # (prompt, sampling keyword arguments)


def unbroken_runs(cases: list[Case], target: str, *, max_tokens: int, timeout: float = 300) -> list[Any]:
    """Each case's unbroken run on ``target`` (``max_tokens``, ``ignore_eos``), a thread each, all at
    once: one batch, as the streams through the kill run are (and in the time of the longest run,
    not of all of them one after another). Returns the completions in the order of ``cases``."""
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda case: complete(case[0], target=target, max_tokens=max_tokens, ignore_eos=True,
                                                  timeout=timeout, **case[1]), cases))


def streams_through_a_kill(cases: list[Case], targets: list[str], kill: Callable[[], None], *, max_tokens: int,
                           min_seen: int, timeout: float = 300) -> tuple[list[Any], list[int]]:
    """Stream every case (``max_tokens``, ``ignore_eos``) through the client with ``targets``, a
    thread each; once every stream has ``min_seen`` tokens and none has all of them, ``kill()``.
    Returns each stream's collected output and how many tokens it had at the kill; any client
    error fails the caller's test with the case that raised it."""
    got: list[Any] = [None] * len(cases)
    seen = [0] * len(cases)
    errors: list[str] = []

    def run(i: int) -> None:
        prompt, sampling = cases[i]
        chunks = []
        try:
            for c in stream(prompt, target=targets, max_tokens=max_tokens, ignore_eos=True, timeout=timeout,
                            **sampling):
                chunks.append(c)
                seen[i] += len(c.token_ids)
            got[i] = collect(chunks)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{cases[i]}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while min(seen) < min_seen and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert min(seen) >= min_seen and max(seen) < max_tokens, (seen, errors)  # every stream is mid-way
    at_kill = list(seen)
    kill()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return got, at_kill


def assert_like_unbroken(cases: list[Case], expected: list[Any], got: list[Any], at_kill: list[int], *,
                         max_tokens: int, max_diverged: int, diverge_before_kill: bool) -> None:
    """Every resumed stream is complete (``max_tokens`` tokens, finish 'length') and equals its
    unbroken run (tokens and text), except at most ``max_diverged`` seeded streams: a seeded draw can
    flip at a near-tie when the streams share batches of another make-up than in the unbroken runs
    (batched logits differ in the last bits: benchmarks/README.md, issue 30), and with ``diverge_before_kill`` such
    a flip must come before the kill, so the resume had no part in it."""
    diverged = []
    for (prompt, sampling), e, g, at in zip(cases, expected, got, at_kill):
        assert len(g.token_ids) == max_tokens and g.finish_reason == e.finish_reason == "length"
        assert g.usage.completion_tokens == max_tokens
        if g.token_ids == e.token_ids:
            assert g.text == e.text
            continue
        first = next(i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b)
        assert "seed" in sampling and (first < at or not diverge_before_kill), \
            (prompt, sampling, at, e.token_ids, g.token_ids)
        diverged.append((prompt, first, at))
    assert len(diverged) <= max_diverged, diverged
