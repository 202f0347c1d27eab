"""Adaptive draft length: how many tokens each request drafts this step.

Model (Leviathan et al. 2023; DuoDecoding's hardware-aware draft budget): with a per-token
acceptance rate a, a window of k drafts yields E(k) = (1 - a^(k+1)) / (1 - a) tokens per target
pass (the accepted prefix plus the target's own token), so E(k) - 1 = a + a^2 + ... + a^k more
than plain decoding: the j-th draft is worth a^j tokens. Costs come from measured times:
    step(n)  seconds of a decode-only target step computing n rows (decodes + drafts), priced from
             the steps measured with that many rows (``RowCost``: the median of the recent ones;
             between measured row counts interpolated, beyond them extrapolated by the fitted slope)
    draft(k, n) seconds the target waits for a drafter call in which n requests draft up to k
             tokens each, priced per drafter pass (``DraftCost``): a fixed part f, then one
             pass over the call's n rows per draft position (k, plus the overlap's guess):
             f + passes x (p + r n), fitted from the measured waits
A step of B decoding requests decodes B tokens in step(B). Drafting R rows in all (k_i per request,
sum R, n requests with k_i > 0) makes it step(B + R) plus the wait draft(max k_i, n) for the
drafts (one call serves the step); in those extra seconds plain decoding would have produced
B / step(B) tokens a second. So
the step's plan (``plan_rows``) takes, for each R, the R most valuable drafts (a_i^j over requests
i and positions j) and keeps the R with the largest net gain  sum a_i^j - extra seconds x B / step(B)
(in tokens; R = 0 means decode plainly this step). draft() fits the measured *wait*, so a drafter
that overlaps its work with the target's step (draft_model.py's overlap) is already credited for
what the overlap hides, as often as it hides it: at one stream most windows are computed during the
verify, at 8 streams one miss among the 8 requests sends a fresh round of 8 rows a pass, and the
waits measured there say so. Seeded requests decide alone (``_best_k``, nominal costs: below).

Why the drafter's wait is priced per pass over the call's rows, not per draft token per request: a
drafter computes one forward pass per draft position over every request in the round, so its wait
grows with the passes (k) and with the rows a pass carries (n), and barely with n x k; a fit per draft
token per request learnt at 1 stream under-prices 8 streams (8 rows a pass), and a fit with one
sample put a cold drafter's whole first round on its one draft token (k = 4 priced at 4x a slow
k = 1 round: nothing drafted at 1 stream until a stale re-probe). ``DraftCost`` keeps each (k, n)
it measured (the mean of its last 5 waits without the slowest, so one cold or spiky round does
not decide), fits f, p, r over them for the shapes it has not measured, and until
``MIN_DRAFT_SAMPLES`` waits are measured at all, prices the wait at 0 (so drafting starts and gets
measured, as a row count never measured is priced optimistically). A shape re-measured after
``stale_after`` steps without a sample of it starts over (the slow waits of a cold drafter or a load
spike do not outlive the probe that finds the drafter fast again).

Why rows are priced from steps with that many rows and planned per step, not by a line fitted to
decode steps and chosen per request: a line's slope is only learnt from steps of different sizes,
and a batch whose requests all draft the same k runs steps of one size (B (1 + k)); and a line
cannot price a kernel tile. The q4 CPU kernel's step is nearly flat up to 8 rows, jumps at 9 and
then grows by the row (benchmarks/README.md, ``drafter_pool_e2e.py``, has the measured curve): a
line fitted to 1-stream steps priced a verify row at a few ms, and 8 streams kept drafting at
0.72x of plain decoding. Planned per step, one request's drafts that push 8 rows to 9 are charged
the whole jump they cost, not a share. A row count never measured is priced optimistically (extrapolated from the
nearest measured one by the fitted slope), so it gets tried and measured; the plain size step(B)
is measured outright: at a batch size whose plain step has no sample, the step decodes plainly
(``choose_step``), at most once per ``stale_after`` steps for each size.

Per request, a is an exponential moving average over the draft positions the target judged
(prior 0.6, so a new request speculates): a verify that kept j of k drafts judged j + 1 positions (j
accepted, then one rejected) or k (all kept); the positions after the first rejection were never
judged. (An average of j / k per verify reads a per-token rate of 0.8 as ~0.6 at k = 4: the
tail a window could not reach counted as rejected, which priced long windows out at 1 stream.)
A request whose drafts keep failing reaches k = 0; it is re-probed with k = 1 every
``probe_every`` steps, so a request whose text turns repetitive picks speculation back up -- unless
even perfect drafts would not pay at this batch (then a probe could not change the answer). That
verdict rests on the fitted draft cost, which only drafting updates: one slow round (a drafter
still warming up, a load spike) would otherwise turn speculation off for good, every later request
included. So after ``stale_after`` steps without a draft sample, the next due probe runs anyway,
followed by one more round at the next step: the first (k = 1) catches the drafter up on the tokens
since it last drafted (not a sample: workers/engine/speculator.py fits steady rounds only), the
second drafts the request's full window (its cap) and re-measures the drafter in the regime the
plan would use, not a k = 1 catch-up.

Worked example: batch 1, step(n) = 20 ms + 1 ms n, a = 0.8, prompt lookup (no draft cost):
a plain step is 21 ms; k = 4 gains E(4) - 1 = 2.36 tokens for 4 ms (0.19 tokens' worth): draft 4.
With a = 0.1 and a drafter at 8 ms a pass, k = 1 gains 0.1 tokens for 9 ms (0.43): decode
plainly. A CPU drafter beside a flat 100 ms GPU-like step, 4 ms + 10 ms a row per pass, a = 0.8,
k = 4 (5 passes with the overlap's guess): at 1 stream the wait is at most 72 ms for 2.36 tokens
(0.72 tokens' worth): draft; at 8 streams 5 x 84 ms = 420 ms for 8 x 2.36 = 18.9 tokens (33.6
tokens' worth at 8 tokens per 100 ms): decode plainly. Batch 8 on a kernel like the q4 one, say
step(8) = 200 ms, step(16) = 480 ms, step(40) = 840 ms, a = 0.8, drafts free: one draft each
(R = 8) gains 6.4 tokens for 280 ms (11.2 tokens' worth at 8 tokens per 200 ms); four each
(R = 32) gains 18.9 for 640 ms (25.6 tokens' worth): decode plainly.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

PRIOR_ACCEPTANCE = 0.6
EMA = 0.15  # weight of the newest judged draft position


class LinearCost:
    """seconds ~ a + b * n, least squares over a window of recent (n, seconds) samples (a short
    window, so warm-up and load spikes age out within a few dozen steps). Until two
    distinct sizes n have been seen, the split of the mean between a and b follows ``prior_ratio``
    (b = prior_ratio * a: what one more token costs relative to the fixed part)."""

    def __init__(self, prior_ratio: float, window: int = 32) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.prior_ratio = prior_ratio
        self.a = self.b = 0.0

    def add(self, n: float, seconds: float) -> None:
        self._samples.append((n, seconds))
        m = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / m
        mean_y = sum(y for _, y in self._samples) / m
        var = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var > 0:
            self.b = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var)
        else:
            self.b = mean_y * self.prior_ratio / (1.0 + self.prior_ratio * mean_x)
        self.a = max(0.0, mean_y - self.b * mean_x)

    def __call__(self, n: float) -> float:
        return self.a + self.b * n


def _nominal(a: float, b: float) -> LinearCost:
    cost = LinearCost(0.0)
    cost.a, cost.b = a, b
    return cost


NOMINAL_STEP = _nominal(1.0, 0.05)


def NOMINAL_DRAFT(k: float, n: float = 1) -> float:  # a constant cost function: drafting is free
    return 0.0


class RowCost:
    """Seconds of a decode-only step by the rows n it computes, from the steps measured with n rows:
    the median of the last ``per_size`` of them (one slow step does not move it). A row count with no
    sample is interpolated between the nearest measured ones below and above; outside the measured
    range it is extrapolated from the nearest measured count by the slope of ``line`` (a least-squares
    fit over every step, LinearCost: with one row count seen so far, its prior split). Nothing
    measured at all: 0 (drafting is free until a step says otherwise, as before the first sample)."""

    def __init__(self, prior_ratio: float, window: int = 32, per_size: int = 5) -> None:
        self.line = LinearCost(prior_ratio, window)
        self._per_size = per_size
        self._by_rows: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}
        self._sizes: list[int] = []  # the measured row counts, sorted

    def add(self, n: int, seconds: float) -> None:
        self.line.add(n, seconds)
        samples = self._by_rows.get(n)
        if samples is None:
            samples = self._by_rows[n] = deque(maxlen=self._per_size)
            bisect.insort(self._sizes, n)
        samples.append(seconds)
        self._medians[n] = statistics.median(samples)

    def measured(self, n: int) -> bool:
        return n in self._medians

    def __call__(self, n: float) -> float:
        med, sizes = self._medians, self._sizes
        if not sizes:
            return 0.0
        j = bisect.bisect_left(sizes, n)
        if j < len(sizes) and sizes[j] == n:
            return med[sizes[j]]
        if 0 < j < len(sizes):  # between two measured counts
            lo, hi = sizes[j - 1], sizes[j]
            return med[lo] + (n - lo) / (hi - lo) * (med[hi] - med[lo])
        nearest = sizes[0] if j == 0 else sizes[-1]
        if len(sizes) == 1:  # one row count: the prior's shape, scaled to what it measured
            return med[nearest] * self.line(n) / max(self.line(nearest), 1e-12)
        return max(0.0, med[nearest] + self.line.b * (n - nearest))


MIN_DRAFT_SAMPLES = 3  # measured drafter waits before they price drafting at all (below: free)
STALE_WEIGHT = 0.05  # weight in the draft cost's fit of a shape not measured lately, per sample


class DraftCost:
    """Seconds the target waits for a drafter call in which n requests draft up to k tokens each.

    A drafter round runs one forward pass per draft position over all of its requests' rows, so
        wait(k, n) = f + passes(k) x (p + r n),   passes(k) = k + extra_passes
    (extra_passes: 1 with the overlap's guess token). f covers the call's fixed part (the link,
    the first pass's catch-up tokens) and what the overlap hides is already out of the measured
    waits it is fitted from. A (k, n) measured ``MIN_DRAFT_SAMPLES`` times or more is priced from its
    own last ``per_shape`` waits, the mean without the slowest (one cold or spiky round does not
    decide, and a mix of overlapped and fresh rounds keeps its mean); others from f, p, r: weighted
    least squares over the measured shapes (each shape's robust mean, weighted by its sample count),
    with weak prior rows for the directions the shapes do not span: f = 0, and r = ``row_ratio`` x p
    (a pass over 8 rows costs 2x one over 1 row: a quantized CPU kernel's weights are read once per
    pass whatever the rows). Fewer than ``min_samples`` waits in all: 0, so drafting is tried and
    measured. Shapes are forgotten once their last sample leaves the ``window`` newest.

    Age (``max_age``, in the caller's steps, given with each sample as ``at``): waits that turned
    drafting off are only re-measured by a probe now and then, so a few slow rounds (a cold drafter,
    a load spike) would otherwise keep their shape's price long after the drafter got fast: a probe's
    one fast wait does not move a mean of the slow ones. So a shape measured again more than max_age
    steps after its last sample starts over from the new wait, and in the fit a shape not measured
    within max_age of the newest sample weighs ``STALE_WEIGHT`` per sample: it still decides what
    no fresh shape says (a pass over 8 rows, at 8 streams that declined to draft), not what they
    contradict."""

    def __init__(self, extra_passes: int = 0, window: int = 32, per_shape: int = 5,
                 min_samples: int = MIN_DRAFT_SAMPLES, row_ratio: float = 0.125, max_age: int | None = None) -> None:
        self.extra_passes = extra_passes
        self.min_samples = min_samples
        self.row_ratio = row_ratio
        self.max_age = max_age
        self._per_shape = per_shape
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)  # shapes of the newest samples
        self._by_shape: dict[tuple[int, int], deque[float]] = {}
        self._robust: dict[tuple[int, int], float] = {}
        self._last_at: dict[tuple[int, int], int] = {}  # shape -> when (the caller's clock) it was last measured
        self._newest_at = 0
        self.f = self.p = self.r = 0.0

    @property
    def samples(self) -> int:
        return len(self._recent)

    def add(self, k: int, n: int, seconds: float, at: int | None = None) -> None:
        """One measured wait of shape (k, n); at: when, on the caller's clock (steps), for max_age."""
        shape = (max(int(k), 0), max(int(n), 1))
        if at is not None and self.max_age is not None:
            last = self._last_at.get(shape)
            if last is not None and at - last > self.max_age:  # re-measured after a drought: a new regime
                self._forget(shape)
            self._last_at[shape] = self._newest_at = at
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            if sum(1 for s in self._recent if s == old) == 1 and old != shape:  # its last sample leaves
                self._forget(old)
        self._recent.append(shape)
        waits = self._by_shape.setdefault(shape, deque(maxlen=self._per_shape))
        waits.append(max(0.0, seconds))
        self._robust[shape] = _trimmed_mean(waits)
        self._fit()

    def _forget(self, shape: tuple[int, int]) -> None:
        self._by_shape.pop(shape, None)
        self._robust.pop(shape, None)
        self._last_at.pop(shape, None)
        if shape in self._recent:
            self._recent = deque((s for s in self._recent if s != shape), maxlen=self._recent.maxlen)

    def _fresh(self, shape: tuple[int, int]) -> bool:
        """Measured within max_age of the newest sample (always, without a clock)."""
        last = self._last_at.get(shape)
        return self.max_age is None or last is None or self._newest_at - last <= self.max_age

    def _fit(self) -> None:
        counts: dict[tuple[int, int], int] = {}
        for s in self._recent:
            counts[s] = counts.get(s, 0) + 1
        rows, ys, ws = [], [], []
        for (k, n), wait in self._robust.items():
            passes = k + self.extra_passes
            rows.append((1.0, float(passes), float(passes * n)))
            ys.append(wait)
            # a shape not measured for max_age steps before the newest sample (another regime: a cold
            # drafter, a load spike) still decides what only it says (e.g. the rows a pass carries), but
            # yields where fresh shapes say otherwise
            ws.append(float(counts.get((k, n), 1)) * (1.0 if self._fresh((k, n)) else STALE_WEIGHT))
        prior = 1e-6 * sum(ws)  # only decides directions the data leave open
        rows += [(1.0, 0.0, 0.0), (0.0, -self.row_ratio, 1.0)]
        ys += [0.0, 0.0]
        ws += [prior, prior]
        free = [0, 1, 2]
        theta = [0.0, 0.0, 0.0]
        while free:
            sol = _weighted_lstsq([[row[j] for j in free] for row in rows], ys, ws)
            if sol is None:
                break
            worst = min(range(len(free)), key=lambda j: sol[j])
            if sol[worst] >= 0.0:
                for j, v in zip(free, sol):
                    theta[j] = v
                break
            free.pop(worst)  # a negative part: fix it at 0 and refit the others
        self.f, self.p, self.r = theta

    def measured(self, k: int, n: int) -> bool:
        return len(self._by_shape.get((k, n), ())) >= self.min_samples

    def __call__(self, k: float, n: float = 1) -> float:
        if k <= 0 or self.samples < self.min_samples:
            return 0.0
        robust = self._robust.get((int(k), int(n)))
        if robust is not None and self.measured(int(k), int(n)):
            return robust
        return self.f + (k + self.extra_passes) * (self.p + self.r * n)


def _trimmed_mean(values: deque[float]) -> float:
    """The mean without the largest value (from 3 values on), else the median."""
    if len(values) < 3:
        return statistics.median(values)
    ordered = sorted(values)[:-1]
    return sum(ordered) / len(ordered)


def _weighted_lstsq(rows: list[list[float]] | list[tuple[float, ...]], ys: list[float],
                    ws: list[float]) -> list[float] | None:
    """argmin_x sum w (row . x - y)^2 by the normal equations (a few unknowns); None if singular."""
    m = len(rows[0])
    a = [[sum(w * r[i] * r[j] for r, w in zip(rows, ws)) for j in range(m)] for i in range(m)]
    b = [sum(w * r[i] * y for r, y, w in zip(rows, ys, ws)) for i in range(m)]
    for c in range(m):  # Gaussian elimination with partial pivoting
        piv = max(range(c, m), key=lambda i: abs(a[i][c]))
        if abs(a[piv][c]) < 1e-18:
            return None
        a[c], a[piv], b[c], b[piv] = a[piv], a[c], b[piv], b[c]
        for i in range(c + 1, m):
            t = a[i][c] / a[c][c]
            for j in range(c, m):
                a[i][j] -= t * a[c][j]
            b[i] -= t * b[c]
    x = [0.0] * m
    for i in reversed(range(m)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, m))) / a[i][i]
    return x


Cost = Callable[[float], float]
DraftWait = Callable[[float, float], float]  # (longest window k, requests drafting n) -> seconds
MARGIN = 0.02  # tokens per drafting request: do not speculate for noise
MAX_PLAN_POINTS = 128  # total draft rows a step's plan evaluates at most (every one up to this, then a stride)


def _best_k(acceptance: float, k_cap: int, step: Cost, draft: DraftWait, batch: int) -> int:
    """One request's k in 0..k_cap with the largest net gain if the whole batch of ``batch`` drafted
    like it (module doc); 0 if none beats the margin. Seeded requests decide with this alone."""
    a = min(acceptance, 0.999)
    plain = max(step(batch), 1e-9)  # seconds of a plain step of the batch
    best_k, best_gain = 0, MARGIN
    for k in range(1, k_cap + 1):
        extra_tokens = (1.0 - a ** (k + 1)) / (1.0 - a) - 1.0
        gain = extra_tokens - (step(batch * (1 + k)) - step(batch) + draft(k, batch)) / plain
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


def _nominal_perfect_pays(k_cap: int, free_draft: bool) -> bool:
    """Whether perfect drafts would pay a seeded request (nominal costs; drafting is free there)."""
    return _best_k(1.0, k_cap, NOMINAL_STEP, NOMINAL_DRAFT, 1) > 0


def plan_rows(requests: Sequence[tuple[float, int]], batch: int, step: Cost, draft: DraftWait,
              base_rows: int = 0, base_k: int = 0, base_n: int = 0) -> list[int]:
    """Draft tokens for each of ``requests`` ((acceptance, cap) each) in one step of ``batch``
    decoding requests, chosen together: the step's rows are what costs, and on a kernel whose step
    grows by whole passes (flat up to 8 rows, say) one request's 4 drafts can cost a whole pass
    that 8 requests' drafts would share. The j-th draft of a request with acceptance a is worth a^j
    tokens (it counts if the j - 1 before it were kept); for each total R of draft rows the R most
    valuable are taken (a request's drafts in order), and the R with the largest gain
        sum of their worth - (step(B + R) - step(B) + draft wait) x B / step(B)
    wins (the second term: tokens that plain decoding would have produced in the extra seconds).
    base_rows / base_k / base_n: draft rows, the longest window and the requests drafting already in
    the step (seeded requests, decided on their own); the drafter call's wait (its passes over the
    rows of every request drafting) is charged once for the step."""
    values = sorted(((min(a, 0.999) ** j, j, i) for i, (a, cap) in enumerate(requests) for j in range(1, cap + 1)),
                    key=lambda v: (-v[0], v[1], v[2]))
    counts = [0] * len(requests)
    if not values:
        return counts
    plain = max(step(batch), 1e-9)
    worth = batch / plain  # tokens per second of plain decoding
    rows0 = batch + base_rows
    step0, wait0 = step(rows0), (draft(base_k, base_n) if base_k else 0.0)
    n = len(values)
    points = set(range(1, min(n, MAX_PLAN_POINTS) + 1)) if n <= MAX_PLAN_POINTS else \
        {1 + (n - 1) * p // (MAX_PLAN_POINTS - 1) for p in range(MAX_PLAN_POINTS)}
    best_r, best_gain, tokens, longest, drafting = 0, 0.0, 0.0, base_k, 0
    for r, (value, j, i) in enumerate(values, 1):
        tokens += value
        drafting += counts[i] == 0
        counts[i] += 1
        longest = max(longest, j)
        if r not in points:
            continue
        gain = tokens - (step(rows0 + r) - step0 + draft(longest, base_n + drafting) - wait0) * worth
        if gain > MARGIN * drafting and gain > best_gain:
            best_r, best_gain = r, gain
    counts = [0] * len(requests)
    for _, _, i in values[:best_r]:
        counts[i] += 1
    return counts


@dataclass
class _Request:
    acceptance: float = PRIOR_ACCEPTANCE
    steps_at_zero: int = 0
    probe_again: bool = False  # a stale probe's second round (the one that measures) is due


class DraftLengthPolicy:
    """k_max: the configured num_speculative_tokens; adaptive False always asks for k_max;
    extra_passes: drafter passes a round runs beyond its k drafts (1 with the overlap's guess)."""

    def __init__(self, k_max: int, adaptive: bool = True, probe_every: int = 8, stale_after: int = 64,
                 extra_passes: int = 0) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.stale_after = stale_after
        self._since_draft = 0  # steps since the draft cost last got a sample
        self._steps = 0  # steps that chose adaptively
        self._plain_tried: dict[int, int] = {}  # batch size -> self._steps when a plain step was last forced for it
        self.step = RowCost(prior_ratio=0.05)  # target step seconds vs rows it computes
        # seconds waiting for a drafter call vs its passes and rows; a shape re-measured after stale_after
        # steps without a sample of it starts over (what it measured before was another regime)
        self.draft = DraftCost(extra_passes, max_age=stale_after)
        self._requests: dict[str, _Request] = {}

    def choose_step(self, asks: Sequence[tuple[str, int, bool]]) -> list[int]:
        """Draft tokens for every decoding request of one step: asks are (request id, limit: its
        remaining budget, reproducible: seeded sampling) for each, so the batch is len(asks).
        Seeded requests decide from their own acceptance and nominal costs only (a step of
        1 + 0.05 per row, drafting free), never from timings or the batch, so the same seed gives the
        same draws; the others are planned together (plan_rows) around them. If a plain step of
        this batch size was never measured, the others decode plainly this step so it is measured
        (at most once per stale_after steps per size: a step with seeded drafts does not measure it)."""
        batch = len(asks)
        ks = [0] * batch
        if not self.adaptive:
            return [max(0, min(self.k_max, limit)) for _, limit, _ in asks]
        if not any(limit > 0 and self.k_max > 0 for _, limit, _ in asks):
            return ks
        self._steps += 1
        self._since_draft += 1
        plain_step = False
        if not self.step.measured(batch):
            last = self._plain_tried.get(batch)
            if last is None or self._steps - last >= self.stale_after:
                self._plain_tried[batch] = self._steps
                plain_step = True
        stale = self._since_draft >= self.stale_after
        planned: list[tuple[int, _Request, int]] = []
        for i, (request_id, limit, reproducible) in enumerate(asks):
            k_cap = min(self.k_max, limit)
            if k_cap <= 0:
                continue
            st = self._requests.setdefault(request_id, _Request())
            if reproducible:
                best = _best_k(st.acceptance, k_cap, NOMINAL_STEP, NOMINAL_DRAFT, 1)
                ks[i] = self._settle(st, best, partial(_nominal_perfect_pays, k_cap), stale=False, cap=k_cap)
            elif plain_step:
                st.probe_again = False  # (a stale probe's second round would not measure in this step)
            else:
                planned.append((i, st, k_cap))
        if planned:
            base_rows, base_k, base_n = sum(ks), max(ks), sum(k > 0 for k in ks)
            step, draft = self.step, self.draft
            plan = plan_rows([(st.acceptance, cap) for _, st, cap in planned], batch, step, draft, base_rows, base_k,
                             base_n)
            rows, longest, drafting = base_rows + sum(plan), max(base_k, *plan), base_n + sum(k > 0 for k in plan)

            probes = [0]  # requests probing in this step so far: their rows share the drafter's passes

            def perfect_pays(cap: int, free_draft: bool) -> bool:
                # a probe is worth it only where some acceptance could make drafting pay: a request
                # with perfect drafts, in this step beside the others' plan and the probes before it
                # (requests that stopped together come due together: 8 probing at once is a round
                # of 8 rows a pass) (free_draft: and a drafter that costs no wait)
                return plan_rows([(1.0, cap)], batch, step, NOMINAL_DRAFT if free_draft else draft, rows + probes[0],
                                 max(longest, 1 if probes[0] else 0), drafting + probes[0])[0] > 0

            for (i, st, cap), best in zip(planned, plan):
                ks[i] = self._settle(st, best, partial(perfect_pays, cap), stale=stale, cap=cap)
                probes[0] += ks[i] > 0 and best == 0
                stale = stale and self._since_draft > 0  # (one stale probe per stale_after steps, not one per request)
        return ks

    def choose(self, request_id: str, limit: int, reproducible: bool = False) -> int:
        """One request's draft tokens in a step where it decodes alone (choose_step of one)."""
        return self.choose_step([(request_id, limit, reproducible)])[0]

    def _settle(self, st: _Request, best_k: int, perfect_pays: Callable[[bool], bool], stale: bool,
                cap: int) -> int:
        """The request's k this step from its plan ``best_k``: a stale probe's second round (its
        full window, ``cap``, so the drafter is re-measured as the plan would use it), or a probe
        every probe_every steps at k = 0. stale: the draft cost has had no sample for stale_after
        steps. perfect_pays(free_draft): whether perfect drafts would pay (with a drafter costing
        no wait)."""
        if st.probe_again:
            st.probe_again = False
            return max(best_k, cap)
        if best_k == 0:
            st.steps_at_zero += 1
            # probe (re-measure acceptance) only where some acceptance could make drafting pay: at a
            # batch where even perfect drafts do not, a probe is a drafter call and a verify for nothing;
            # unless that verdict rests on a draft cost nobody has re-measured for stale_after steps
            # (and a cheaper drafter could change it: where even free drafts do not pay, the
            # target's own rows decide and a re-measure could not)
            if st.steps_at_zero % self.probe_every == 0:
                if stale and perfect_pays(True):
                    self._since_draft = 0  # one stale probe per stale_after steps, not one per request
                    st.probe_again = True
                    return 1
                if perfect_pays(False):
                    return 1
        else:
            st.steps_at_zero = 0
        return best_k

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """One verify of this request: ``accepted`` of its ``drafted`` tokens were kept."""
        if drafted <= 0:
            return
        st = self._requests.setdefault(request_id, _Request())
        for outcome in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            st.acceptance += EMA * (outcome - st.acceptance)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only target step computed ``num_tokens`` rows (decodes + drafts)."""
        self.step.add(num_tokens, seconds)

    def observe_draft(self, k: int, seconds: float, requests: int = 1) -> None:
        """A drafter call waited ``seconds`` for ``requests`` requests drafting up to ``k`` tokens each."""
        self.draft.add(k, requests, seconds, at=self._steps)
        self._since_draft = 0

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def request_state(self, request_id: str) -> tuple[float, int]:
        """(acceptance, steps at zero) of one request: what its next choices depend on (migration)."""
        st = self._requests.get(request_id, _Request())
        return st.acceptance, st.steps_at_zero

    def set_request_state(self, request_id: str, state: tuple[float, int]) -> None:
        self._requests[request_id] = _Request(float(state[0]), int(state[1]))

    def acceptance(self, request_id: str) -> float:
        return self._requests.get(request_id, _Request()).acceptance
