"""How many tokens one step may compute: a fixed budget, or one sized to a target inter-token latency.

Every step computes one token per decoding request (D rows) plus prompt chunks (P tokens). The
step's wall time is the inter-token latency (ITL) every decoding request sees, so a large prompt
chunk in a step stalls all of them for that step. Two policies:

    FixedBudget(n)      D + P <= n (``scheduler.max_num_batched_tokens``, 512 by default).
    ItlBudget(target)   P is what fits in ``target`` seconds after the decodes, by a cost model of the
                        step measured on this engine:

                            step_s ~= a + b * D + c * P          (least squares, recent steps weigh more)

                        P = clamp((target - a - b * D) / c, MIN_PREFILL_TOKENS, n - D). So under a
                        light load a prompt still goes in one chunk; as decodes fill the step, prompt
                        chunks shrink, and at least MIN_PREFILL_TOKENS per step keep new requests
                        moving (their TTFT grows instead of everyone's ITL). The cap n stays.

The cost model: recursive least squares with forgetting factor ``FORGET`` (a memory of ~1/(1 -
FORGET) steps) over (1, D, P) -> step seconds, so it follows a machine whose speed changes (another
process takes a core). Until it has seen ``WARMUP_STEPS`` steps with prompt tokens and as many
without, or while c is not positive, the budget is the fixed n (no guess is made).

Worked example: a = 2 ms, b = 1.5 ms per decode row, c = 0.5 ms per prompt token, target 50 ms,
D = 20 decodes: P = (50 - 2 - 30) / 0.5 = 36 prompt tokens this step (not 492).
"""

from __future__ import annotations

import math
from typing import Protocol

FORGET = 0.98  # weight of a step observed k steps ago: FORGET ** k
WARMUP_STEPS = 4  # steps with prompt tokens (and without) before the model is trusted
_MAX_TRACE = 3e3  # the initial (uninformed) trace of the inverse information
MIN_PREFILL_TOKENS = 16  # prompt tokens a step may always take, however slow the decodes make it


class TokenBudget(Protocol):
    def tokens(self, num_decodes: int) -> int:
        """The step's token budget (decode rows included) when ``num_decodes`` requests decode."""

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        """A step ran: its shape and wall time."""


class FixedBudget:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def tokens(self, num_decodes: int) -> int:
        return self.max_tokens

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        pass


class StepCostModel:
    """step_s ~= a + b * D + c * P by recursive least squares with forgetting (see the module doc).
    Plain floats: three coefficients are cheaper in Python than in tensor ops."""

    def __init__(self, forget: float = FORGET) -> None:
        self.forget = forget
        self.theta = [0.0, 0.0, 0.0]  # (a, b, c)
        self.cov = [[1e3 if i == j else 0.0 for j in range(3)] for i in range(3)]  # inverse information
        self.num_with_prefill = 0
        self.num_without_prefill = 0

    def observe(self, d: int, p: int, seconds: float) -> None:
        x = (1.0, float(d), float(p))
        cov = self.cov
        # forget only while the information is bounded: steps that all look alike (no prompt tokens
        # for a while) would otherwise blow up the uncertainty of c ("wind-up") and the next
        # prompt chunk would swing the model
        keep = self.forget if sum(cov[i][i] for i in range(3)) < _MAX_TRACE else 1.0
        px = [sum(cov[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = keep + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - sum(self.theta[i] * x[i] for i in range(3))
        self.theta = [self.theta[i] + gain[i] * err for i in range(3)]
        self.cov = [[(cov[i][j] - gain[i] * px[j]) / keep for j in range(3)] for i in range(3)]
        if p:
            self.num_with_prefill += 1
        else:
            self.num_without_prefill += 1

    @property
    def ready(self) -> bool:
        a, b, c = self.theta
        # a and b alone may be poorly told apart (the number of decodes hardly changes under a steady
        # load), but a + b * D is well measured near the D seen; only c must be a positive cost
        return (min(self.num_with_prefill, self.num_without_prefill) >= WARMUP_STEPS
                and c > 0 and all(map(math.isfinite, (a, b, c))))

    def predict(self, d: int, p: int) -> float:
        a, b, c = self.theta
        return a + b * d + c * p


class ItlBudget:
    """Prompt tokens per step sized so the step takes about ``target_s`` (see the module doc)."""

    def __init__(self, target_s: float, max_tokens: int, model: StepCostModel | None = None) -> None:
        assert target_s > 0 and max_tokens >= 1
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.model = model or StepCostModel()

    def tokens(self, num_decodes: int) -> int:
        if not self.model.ready:
            return self.max_tokens
        a, b, c = self.model.theta
        room = (self.target_s - a - b * num_decodes) / c
        prefill = max(MIN_PREFILL_TOKENS, int(room))
        return max(1, min(self.max_tokens, num_decodes + prefill))

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        self.model.observe(num_decode_rows, num_prefill_tokens, seconds)


def make_budget(max_num_batched_tokens: int, target_itl_ms: float | None) -> TokenBudget:
    """The policy ``scheduler.target_itl_ms`` asks for (None: the fixed budget)."""
    if target_itl_ms is None:
        return FixedBudget(max_num_batched_tokens)
    return ItlBudget(target_itl_ms / 1e3, max_num_batched_tokens)
