"""GrammarGate: structured-output requests wait here, outside the scheduler, while their grammar
compiles on the compiler's thread, so a compile never stalls a step.

The engine gives each structured request a GrammarMatcher at once (its runner state needs it,
and a disaggregated decode side restores the generator before the first token) and parks the
sequence here. Each step it takes the requests whose compile finished: ready ones join the
scheduler (a new request as waiting, a disaggregated one whose KV has arrived as running);
failed ones, and ones still compiling past the time limit, end with the InvalidRequestError
naming ``structured.<kind>``. When nothing else can run, ``wait`` sleeps until a compile finishes
(bounded), so the engine thread does not spin.

Example (what Engine does)::

    gate = GrammarGate(compiler)
    matcher = gate.matcher(params.structured)         # compile starts (or hits the cache)
    gate.park(seq, matcher, running=False)
    for seq, running, error in gate.take_ready(): ...  # each step
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.errors import InvalidRequestError
from workers.engine.sequence import Sequence
from workers.structured.grammar import GrammarCompiler
from workers.structured.matcher import GrammarMatcher
from workers.structured.spec import StructuredOutput


@dataclass
class _Parked:
    seq: Sequence
    matcher: GrammarMatcher
    running: bool  # admit as running (its prompt KV is in place: disaggregated decode)
    deadline: float


class GrammarGate:
    """Owns the compiler (built on first use by ``make_compiler``) and the parked requests."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._parked: dict[str, _Parked] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A new request's matcher; its grammar compiles in the background (or is cached)."""
        c = self.compiler
        return GrammarMatcher(c.submit(spec), spec, timeout_s=c.timeout_s)

    def park(self, seq: Sequence, matcher: GrammarMatcher, running: bool) -> None:
        self._parked[seq.request_id] = _Parked(seq, matcher, running, time.monotonic() + self.compiler.timeout_s)

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parked

    def discard(self, request_id: str) -> None:
        self._parked.pop(request_id, None)

    def take_ready(self) -> list[tuple[Sequence, bool, InvalidRequestError | None]]:
        """Parked requests whose compile ended (or timed out), in arrival order: (seq, running,
        None if it may run else the error that ends it). They are no longer parked."""
        now = time.monotonic()
        out: list[tuple[Sequence, bool, InvalidRequestError | None]] = []
        for rid, p in list(self._parked.items()):
            if not p.matcher.ready and now < p.deadline:
                continue
            del self._parked[rid]
            try:
                p.matcher.check()  # raises the compile's error, or the time limit's
            except InvalidRequestError as e:
                out.append((p.seq, p.running, e))
            else:
                out.append((p.seq, p.running, None))
        return out

    def wait(self, timeout_s: float) -> None:
        """Sleep until some parked compile finishes, at most timeout_s (nothing else to do)."""
        pending = [p.matcher.future for p in self._parked.values() if not p.matcher.ready]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
