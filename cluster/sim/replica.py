"""One simulated replica: a prefill FIFO and a continuously batched decode, in O(log b) per event.

The service model (fitted per profile, cluster/autoscale/profile.py ``ServiceModel``):
    prefill     requests are prefilled one at a time in arrival order; a prompt of P tokens takes
                ``prefill_base_s + prefill_per_token_s * P``. Its end is the request's first token.
    decode      up to ``max_batch`` sequences decode together; one step of a batch of B takes
                ``decode_base_s + decode_per_seq_s * B`` and gives every sequence one token.
                Sequences beyond ``max_batch`` wait (FIFO) for a slot.
    colocated   one engine does both: while a prompt is being prefilled the decode batch does not
                advance (the prefill occupies the engine's steps; with chunked prefill the same
                stall is spread over several steps, the total is the same).

Virtual clock: between two events the batch size B is constant, so every sequence in the batch
gains tokens at the same rate 1 / step(B). ``V`` counts tokens generated per batch slot since the
replica started; a sequence joining at V0 with n tokens to go finishes when V = V0 + n. The batch
is a heap keyed by that finish value, so the next completion is one peek: (min_finish - V) x
step(B) seconds away. Each join, finish or prefill start/end is O(log b) and the replica keeps
O(1) running sums, so the load numbers a routing policy sees (KV held, outstanding tokens) cost
O(1) too:
    held tokens   = sum of batch prompts + (B * V - sum of join values)   (prompt + generated so far)
    outstanding   = queued prompt tokens + waiting outputs + (sum of finish values - B * V)

Example (base 10 ms, 1 ms per sequence; two sequences of 5 and 3 tokens join at t = 0): step(2) =
12 ms, the 3-token one leaves at 36 ms, then step(1) = 11 ms: the other's last 2 tokens end at
58 ms.

Speculative decoding (cluster/sim/spec.py sets it up): a sequence that drafts k tokens per step
with per-token acceptance a gains ``rate`` = E(k) = (1 - a^(k+1)) / (1 - a) tokens per step on
average, so it needs tokens / rate steps: V counts *steps*, and the load numbers above are then in
steps (time to finish), not tokens. Each verified draft token adds ``verify_token_cost`` of a
decode row to the step, and the step waits ``wait_s`` for the drafts the overlap did not hide:
    step(B) = decode_base_s + decode_per_seq_s x (B + verify_token_cost x sum of k) + wait_s
With no speculating sequence (rate 1, k 0, wait 0) every number is exactly the plain model's.
``counters`` (a SpecCounters) integrates tokens, verifies, drafts and waits over steps.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from cluster.autoscale.profile import ServiceModel

if TYPE_CHECKING:
    from cluster.sim.spec import SpecCounters


class SimReplica:
    """The state of one replica. The simulator (cluster/sim/simulator.py) owns the events: every method
    takes ``now`` and returns what the simulator must schedule; none touches the event heap."""

    __slots__ = ("worker_id", "pool", "svc", "colocated", "state", "created_at", "ready_at", "left_at",
                 "prefill_queue", "prefill_queued_tokens", "prefilling", "prefill_tokens", "prefill_start", "prefill_end",
                 "v", "t_last", "batch", "sum_join", "sum_finish", "sum_prompt", "waiting", "waiting_tokens",
                 "version", "in_flight", "drain_at", "rate_sum", "k_sum", "n_spec", "wait_s", "verify_token_cost",
                 "counters", "v_counted")

    def __init__(self, worker_id: str, pool: str, svc: ServiceModel, colocated: bool, now: float) -> None:
        self.worker_id, self.pool, self.svc, self.colocated = worker_id, pool, svc, colocated
        self.state = "starting"  # starting | ready | draining | gone
        self.created_at, self.ready_at, self.left_at = now, float("inf"), float("inf")
        self.prefill_queue: deque[tuple[int, int]] = deque()  # (request, prompt tokens)
        self.prefill_queued_tokens = 0
        self.prefilling = -1  # request being prefilled, -1 = none
        self.prefill_tokens = 0
        self.prefill_start = self.prefill_end = now
        self.v, self.t_last = 0.0, now
        self.batch: list[tuple[float, int, int, float, float, int]] = []  # heap of (finish V, request, prompt,
        #                                                                    join V, tokens per step, drafts per step)
        self.sum_join = self.sum_finish = 0.0
        self.sum_prompt = 0
        self.waiting: deque[tuple[int, float, int, float, int]] = deque()  # (request, tokens to decode, prompt,
        #                                                                      tokens per step, drafts per step)
        self.waiting_tokens = 0.0
        self.version = 0  # bumps whenever the next decode completion moves (stale events are skipped)
        self.in_flight = 0  # requests on this replica (queued, prefilling, waiting or decoding)
        self.drain_at = float("inf")  # when the current drain began (inf: not draining)
        self.rate_sum = 0.0  # sum over the batch of tokens per step (1 for a plain sequence)
        self.k_sum = 0  # sum over the batch of drafts per step
        self.n_spec = 0  # sequences in the batch that draft
        self.wait_s = 0.0  # per step, waiting for drafts (cluster/sim/spec.py)
        self.verify_token_cost = 0.0
        self.counters: SpecCounters | None = None  # None: no accounting
        self.v_counted = 0.0  # V up to which the counters have been integrated

    # -------------------------------------------------------------- clock
    def _step_s(self) -> float:
        return self.verify_step_s() + self.wait_s

    def verify_step_s(self) -> float:
        """The step's compute without the wait for drafts."""
        return self.svc.decode_base_s + self.svc.decode_per_seq_s * (len(self.batch) + self.verify_token_cost * self.k_sum)

    def _paused(self) -> bool:
        return self.colocated and self.prefilling >= 0

    def _v_at(self, now: float) -> float:
        if not self.batch or self._paused():
            return self.v
        return self.v + (now - self.t_last) / self._step_s()

    def _advance(self, now: float) -> None:
        self.v = self._count(now)
        self.t_last = now

    def _count(self, now: float) -> float:
        v = self._v_at(now)
        if self.counters is not None and v > self.v_counted:
            self.counters.add(v - self.v_counted, self.rate_sum, len(self.batch), self.n_spec, self.k_sum,
                              self.wait_s, self.verify_step_s())
            self.v_counted = v
        return v

    def sync(self, now: float) -> None:
        """Integrate the counters up to ``now``; the clock itself is left alone, so a run with
        counters takes exactly the float path of one without."""
        self._count(now)

    def set_wait(self, wait_s: float, now: float) -> None:
        """From ``now`` each step waits ``wait_s`` for drafts (the caller reschedules)."""
        self._advance(now)
        if wait_s != self.wait_s:
            self.wait_s = wait_s
            self.version += 1

    def next_decode_done(self, now: float) -> float | None:
        """When the next sequence finishes at the current rate (None: empty or paused)."""
        if not self.batch or self._paused():
            return None
        return now + max(0.0, self.batch[0][0] - self.v) * self._step_s()

    # -------------------------------------------------------------- prefill
    def enqueue_prefill(self, req: int, prompt: int, now: float) -> float | None:
        """Queue a prompt; returns the prefill's end time if it starts now."""
        self.in_flight += 1
        self.prefill_queue.append((req, prompt))
        self.prefill_queued_tokens += prompt
        return self._start_prefill(now) if self.prefilling < 0 else None

    def _start_prefill(self, now: float) -> float | None:
        if not self.prefill_queue:
            return None
        self._advance(now)  # a colocated decode pauses from now
        req, prompt = self.prefill_queue.popleft()
        self.prefill_queued_tokens -= prompt
        self.prefilling, self.prefill_tokens = req, prompt
        self.version += 1
        self.prefill_start, self.prefill_end = now, now + self.svc.prefill_s(prompt)
        return self.prefill_end

    def finish_prefill(self, now: float) -> tuple[int, float | None]:
        """The running prefill ends: (its request, the next prefill's end time or None)."""
        req = self.prefilling
        self.prefilling, self.prefill_tokens = -1, 0
        self.t_last = now  # a paused decode resumes from now (V did not move)
        self.version += 1
        return req, self._start_prefill(now)

    def release(self) -> None:
        """A request left this replica without decoding here (disaggregated prefill, or 1 token)."""
        self.in_flight -= 1

    # -------------------------------------------------------------- decode
    def join_decode(self, req: int, tokens: float, prompt: int, now: float, *, counted: bool = True,
                    rate: float = 1.0, k: int = 0) -> None:
        """A sequence with ``tokens`` tokens still to generate joins (or waits for a slot).
        counted=False: it is already in ``in_flight`` (colocated: it was prefilled here).
        rate, k: tokens per step and drafts per step (speculation; module docstring)."""
        if counted:
            self.in_flight += 1
        self._advance(now)
        if len(self.batch) < self.svc.max_batch:
            self._admit(req, tokens, prompt, rate, k)
        else:
            self.waiting.append((req, tokens, prompt, rate, k))
            self.waiting_tokens += tokens
        self.version += 1

    def _admit(self, req: int, tokens: float, prompt: int, rate: float = 1.0, k: int = 0) -> None:
        finish = self.v + tokens / rate
        heapq.heappush(self.batch, (finish, req, prompt, self.v, rate, k))
        self.sum_join += self.v
        self.sum_finish += finish
        self.sum_prompt += prompt
        self.rate_sum += rate
        self.k_sum += k
        self.n_spec += k > 0

    def _drop(self, rate: float, k: int) -> None:
        self.rate_sum -= rate
        self.k_sum -= k
        self.n_spec -= k > 0

    def finish_decodes(self, now: float) -> list[int]:
        """Every sequence done by ``now`` leaves (returned); waiting ones take the freed slots.
        Called at the time ``next_decode_done`` gave (the version check makes sure it is still
        current), so the first sequence is due by construction: it leaves even when float
        rounding of ``now`` leaves V a hair short (which would otherwise re-schedule forever)."""
        self._advance(now)
        done = []
        eps = 1e-9 * max(1.0, self.v)
        if self.batch:
            self.v = max(self.v, self.batch[0][0])
        while self.batch and self.batch[0][0] <= self.v + eps:
            finish, req, prompt, join, rate, k = heapq.heappop(self.batch)
            self.sum_finish -= finish
            self.sum_join -= join
            self.sum_prompt -= prompt
            self._drop(rate, k)
            done.append(req)
        if not self.batch:  # re-anchor: keeps the running sums exact over a long run
            self.sum_join = self.sum_finish = self.rate_sum = 0.0
        while self.waiting and len(self.batch) < self.svc.max_batch:
            req, tokens, prompt, rate, k = self.waiting.popleft()
            self.waiting_tokens -= tokens
            self._admit(req, tokens, prompt, rate, k)
        self.in_flight -= len(done)
        self.version += 1
        return done

    # -------------------------------------------------------------- migration (cluster/sim/migration.py)
    def longest_decode(self, now: float) -> tuple[int, float, int] | None:
        """(request, tokens still to generate, context tokens) of the decoding or waiting sequence
        with the most tokens to go, or None when none is here: the one a drain by migration moves
        first. Context = the tokens its KV holds: prompt + generated so far."""
        v = self._v_at(now)
        best = max((((f - v) * rate, req, prompt + round((v - join) * rate)) for f, req, prompt, join, rate, _ in self.batch),
                   default=None)
        for req, tokens, prompt, _, _ in self.waiting:
            if best is None or tokens > best[0]:
                best = (float(tokens), req, prompt)
        return None if best is None else (best[1], max(0.0, best[0]), best[2])

    def remove_decode(self, req: int, now: float) -> tuple[float, int]:
        """Take a decoding or waiting sequence off this replica (it migrates): returns (tokens
        still to generate, context tokens its KV holds = prompt + generated so far). Waiting
        sequences take the freed batch slot, as when one finishes."""
        self._advance(now)
        for i, (finish, r, prompt, join, rate, k) in enumerate(self.batch):
            if r == req:
                self.batch[i] = self.batch[-1]
                self.batch.pop()
                heapq.heapify(self.batch)
                self.sum_finish -= finish
                self.sum_join -= join
                self.sum_prompt -= prompt
                self._drop(rate, k)
                left, context = max(0.0, finish - self.v) * rate, prompt + round((self.v - join) * rate)
                break
        else:
            i = next(i for i, w in enumerate(self.waiting) if w[0] == req)
            _, tokens, prompt, _, _ = self.waiting[i]
            del self.waiting[i]
            self.waiting_tokens -= tokens
            left, context = float(tokens), prompt
        if not self.batch:
            self.sum_join = self.sum_finish = self.rate_sum = 0.0
        while self.waiting and len(self.batch) < self.svc.max_batch:
            r, tokens, prompt, rate, k = self.waiting.popleft()
            self.waiting_tokens -= tokens
            self._admit(r, tokens, prompt, rate, k)
        self.in_flight -= 1
        self.version += 1
        return left, context

    def take_queued_prefills(self) -> list[int]:
        """Prompts queued here and not started (they go to another replica: nothing computed is lost)."""
        reqs = [req for req, _ in self.prefill_queue]
        self.prefill_queue.clear()
        self.prefill_queued_tokens = 0
        self.in_flight -= len(reqs)
        return reqs

    # -------------------------------------------------------------- load
    def held_tokens(self, now: float) -> int:
        return int(self.sum_prompt + len(self.batch) * self._v_at(now) - self.sum_join)

    def outstanding_tokens(self, now: float) -> int:
        """Prompt tokens not yet prefilled (the running prefill pro rata) + output tokens to go."""
        running = 0.0
        if self.prefilling >= 0 and self.prefill_end > self.prefill_start:
            running = self.prefill_tokens * (self.prefill_end - now) / (self.prefill_end - self.prefill_start)
        return round(self.prefill_queued_tokens + running + self.waiting_tokens
                     + self.sum_finish - len(self.batch) * self._v_at(now))

    def num_running(self) -> int:
        return len(self.batch) + (self.prefilling >= 0)

    def num_waiting(self) -> int:
        return len(self.prefill_queue) + len(self.waiting)

    def idle(self) -> bool:
        return self.in_flight == 0
