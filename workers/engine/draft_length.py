"""Adaptive draft length: how many tokens to draft for a request this step.

Model (Leviathan et al. 2023; DuoDecoding's hardware-aware draft budget): with a per-token
acceptance rate a, a window of k drafts yields E(k) = (1 - a^(k+1)) / (1 - a) tokens per target
pass (the accepted prefix plus the target's own token), so E(k) - 1 more than plain decoding.
Costs are fitted online from measured times:
    step(n)  = s0 + s1 n   seconds of a decode-only target step computing n tokens (decodes + drafts)
    draft(k) = d0 + d1 k   seconds the target waits for a drafter call drafting k tokens per request
A step of B decoding requests produces tokens at rate r = B / step(B). Drafting k tokens for one
request adds s1 k to the step, plus its share draft(k) / B of the wait for drafts (one call serves
the batch). draft() fits the measured *wait*, so a drafter that overlaps its work with the target's
step (draft_model.py's overlap) is already credited for what the overlap hides. The policy picks
the k in 0..k_max with the largest net gain  E(k) - 1 - r * extra_seconds(k)  (in tokens; k = 0
means decode plainly this step).

Per request, a is an exponential moving average of accepted / drafted (prior 0.6, so a new request
speculates). A request whose drafts keep failing reaches k = 0; it is re-probed with k = 1 every
``probe_every`` steps, so a request whose text turns repetitive picks speculation back up -- unless
even perfect drafts would not pay at this batch (then a probe could not change the answer). That
verdict rests on the fitted draft cost, which only drafting updates: one slow round (a drafter
still warming up, a load spike) would otherwise turn speculation off for good, every later request
included. So after ``stale_after`` choices without a draft sample, the next due probe runs anyway,
followed by one more round at the next step: the first catches the drafter up on the tokens since
it last drafted (not a sample: workers/engine/speculator.py fits steady rounds only), the second
re-measures it.

Worked example: batch 1, step(n) = 20 ms + 1 ms n, a = 0.8, prompt lookup (no draft cost):
r = 1/21 tokens/ms; k = 4 gains E(4) - 1 = 2.36 tokens for 4 ms (0.19 tokens' worth): draft 4.
With a = 0.1 and a drafter at 8 ms a token, k = 1 gains 0.1 tokens for 9 ms (0.43): decode
plainly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.6
EMA = 0.3  # weight of the newest observation


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
NOMINAL_DRAFT = _nominal(0.0, 0.0)


def _best_k(acceptance: float, k_cap: int, step: LinearCost, draft: LinearCost, batch: int) -> int:
    """The k in 0..k_cap with the largest net gain (module doc); 0 if none beats a small margin."""
    a = min(acceptance, 0.999)
    rate = batch / max(step(batch), 1e-9)  # tokens per second of plain decoding
    best_k, best_gain = 0, 0.02  # a margin: do not speculate for noise
    for k in range(1, k_cap + 1):
        extra_tokens = (1.0 - a ** (k + 1)) / (1.0 - a) - 1.0
        gain = extra_tokens - rate * (step.b * k + draft(k) / batch)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


@dataclass
class _Request:
    acceptance: float = PRIOR_ACCEPTANCE
    steps_at_zero: int = 0
    probe_again: bool = False  # a stale probe's second round (the one that measures) is due


class DraftLengthPolicy:
    """k_max: the configured num_speculative_tokens; adaptive False always asks for k_max."""

    def __init__(self, k_max: int, adaptive: bool = True, probe_every: int = 8, stale_after: int = 64) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.stale_after = stale_after
        self._since_draft = 0  # choices since the draft cost last got a sample
        self.step = LinearCost(prior_ratio=0.05)  # target step seconds vs tokens it computes
        self.draft = LinearCost(prior_ratio=1e3)  # seconds waiting for a drafter call vs tokens drafted per request
        self._requests: dict[str, _Request] = {}

    def choose(self, request_id: str, limit: int, batch: int = 1, reproducible: bool = False) -> int:
        """Draft tokens for this request this step, at most ``limit`` (its remaining budget);
        batch: decoding requests in the step. reproducible (seeded sampling): decide from the
        request's own acceptance and nominal costs only (a step of 1 + 0.05 per token, drafting
        free), never from timings or the batch, so the same seed gives the same draws."""
        k_cap = min(self.k_max, limit)
        if k_cap <= 0:
            return 0
        if not self.adaptive:
            return k_cap
        st = self._requests.setdefault(request_id, _Request())
        step, draft = (NOMINAL_STEP, NOMINAL_DRAFT) if reproducible else (self.step, self.draft)
        batch = 1 if reproducible else batch
        best_k = _best_k(st.acceptance, k_cap, step, draft, batch)
        self._since_draft += 1
        if st.probe_again:
            st.probe_again = False
            return max(best_k, 1)
        if best_k == 0:
            st.steps_at_zero += 1
            # probe (re-measure acceptance) only where some acceptance could make drafting pay: at a
            # batch where even perfect drafts do not, a probe is a drafter call and a verify for nothing;
            # unless that verdict rests on a draft cost nobody has re-measured for stale_after choices
            stale = not reproducible and self._since_draft >= self.stale_after
            if st.steps_at_zero % self.probe_every == 0 and (stale or _best_k(1.0, k_cap, step, draft, batch)):
                if stale:
                    self._since_draft = 0  # one stale probe per stale_after choices, not one per request
                    st.probe_again = True
                return 1
        else:
            st.steps_at_zero = 0
        return best_k

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """One verify of this request: ``accepted`` of its ``drafted`` tokens were kept."""
        if drafted <= 0:
            return
        st = self._requests.setdefault(request_id, _Request())
        st.acceptance += EMA * (accepted / drafted - st.acceptance)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only target step computed ``num_tokens`` tokens (decodes + drafts)."""
        self.step.add(num_tokens, seconds)

    def observe_draft(self, tokens_per_request: float, seconds: float) -> None:
        self.draft.add(tokens_per_request, seconds)
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
