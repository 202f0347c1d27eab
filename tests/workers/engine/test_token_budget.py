"""Token budgets (workers/engine/token_budget.py): the cost model recovers a step's cost from
observed steps, the ITL budget sizes prompt chunks to the target and never below the floor or above
the cap, it is the fixed budget until it has seen enough, and a scheduler driven by a simulated
clock keeps every step near the target while a fixed budget does not. No model, no wall clock."""

from __future__ import annotations

import random

import pytest

from testkit.tolerance import estimate
from workers.config import SchedulerConfig
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.token_budget import MIN_PREFILL_TOKENS, WARMUP_STEPS, FixedBudget, ItlBudget, StepCostModel
from workers.errors import ConfigError
from workers.sampling_params import SamplingParams

A, B, C = 0.004, 0.0015, 0.0005  # the simulated step: 4 ms + 1.5 ms per decode row + 0.5 ms per prompt token


def _cost(d: int, p: int, noise: float = 0.0, rng: random.Random | None = None) -> float:
    return (A + B * d + C * p) * (1 + (rng.uniform(-noise, noise) if rng else 0.0))


def test_cost_model_recovers_the_step_cost():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        d, p = rng.randrange(1, 64), rng.choice([0, 0, rng.randrange(1, 512)])
        model.observe(d, p, _cost(d, p, 0.05, rng))
    assert model.ready
    a, b, c = model.theta
    fit = "a least-squares fit to 200 steps with +-5% noise: the fixed cost a is the smallest term, so the loosest"
    assert a == estimate(A, rel=0.3, why=fit) and b == estimate(B, rel=0.1, why=fit) and c == estimate(C, rel=0.1, why=fit)


def test_cost_model_follows_a_slower_machine():
    """Another process takes half the core: steps take twice as long; the model follows in tens of steps."""
    rng = random.Random(1)
    model = StepCostModel()
    for slow in (1.0, 2.0):
        for _ in range(150):
            d, p = rng.randrange(1, 64), rng.choice([0, rng.randrange(1, 512)])
            model.observe(d, p, slow * _cost(d, p))
    assert model.predict(32, 100) == estimate(2 * _cost(32, 100), rel=0.05,
                                              why="an online fit still forgetting the faster machine's steps")


def test_cost_model_does_not_wind_up_on_alike_steps():
    """Hundreds of decode-only steps of one shape (nothing new about c) leave c where it was."""
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(100):
        d, p = rng.randrange(1, 64), rng.choice([0, rng.randrange(1, 512)])
        model.observe(d, p, _cost(d, p))
    c_before = model.theta[2]
    for _ in range(2000):
        model.observe(16, 0, _cost(16, 0))
    model.observe(16, 400, _cost(16, 400) * 1.2)  # one noisy prompt step after the lull
    assert model.theta[2] == estimate(c_before, rel=0.25, why="one noisy prompt step may move c a little, not wind it up")


def test_itl_budget_sizes_chunks_with_floor_and_cap():
    model = StepCostModel()
    budget = ItlBudget(0.050, 512, model)
    assert budget.tokens(20) == 512  # not ready: the fixed cap
    for i in range(WARMUP_STEPS * 4):
        d, p = 10 + i, (0 if i % 2 else 40 + 10 * i)
        model.observe(d, p, _cost(d, p))
    assert model.ready
    rounding = "the fit's residual error and rounding to whole tokens: a token or two"
    assert budget.tokens(20) == estimate(20 + (0.050 - A - B * 20) / C, abs=2, why=rounding)  # the worked example: 36
    assert budget.tokens(60) == 60 + MIN_PREFILL_TOKENS  # the decodes alone overrun the target: the floor
    assert budget.tokens(0) == estimate((0.050 - A) / C, abs=2, why=rounding)  # no decodes: 92 prompt tokens
    assert ItlBudget(1.0, 512, model).tokens(4) == 512  # a loose target: the cap


def test_fixed_budget_and_config():
    assert FixedBudget(512).tokens(100) == 512
    assert SchedulerConfig(target_itl_ms=40).target_itl_ms == 40
    for bad in (0, -1, float("nan"), float("inf"), True, "50"):
        with pytest.raises(ConfigError, match="^scheduler.target_itl_ms="):
            SchedulerConfig(target_itl_ms=bad)


def _simulate(config: SchedulerConfig, steps: int = 400, seed: int = 0) -> tuple[list[float], int]:
    """A scheduler over a simulated clock (step cost _cost, 5% noise): 24 requests decode, a 300-token
    prompt arrives every 12 steps (each new request decodes 40 tokens, then leaves). -> (step
    seconds of the steps with decodes, prompts finished)."""
    rng = random.Random(seed)
    sched = Scheduler(config, BlockManager(4096, 16))
    todo: dict[str, int] = {}
    n = 0

    def add(prompt_len: int, out: int) -> None:
        nonlocal n
        sched.add(Sequence(f"r{n}", [rng.randrange(100) for _ in range(prompt_len)], SamplingParams(), n))
        todo[f"r{n}"] = out
        n += 1

    for _ in range(24):
        add(8, 10_000)
    itl, finished = [], 0
    for step in range(steps):
        if step % 12 == 0:
            add(300, 40)
        out = sched.schedule()
        d, p = out.token_split()
        seconds = _cost(d, p, 0.05, rng)
        sched.commit(out)
        sched.observe(d, p, seconds)
        if d:
            itl.append(seconds)
        by_id = {s.request_id: s for s in sched.running}
        for c in out.chunks:
            s = by_id[c.request_id]
            if c.sample:
                s.append_token(7)
                if s.num_output_tokens >= todo[s.request_id]:
                    sched.remove(s)
                    s.status = SequenceStatus.FINISHED
                    finished += 1
    return itl, finished


def test_itl_budget_keeps_steps_near_the_target_where_the_fixed_budget_does_not():
    fixed, done_fixed = _simulate(SchedulerConfig(max_num_batched_tokens=512))
    slo, done_slo = _simulate(SchedulerConfig(max_num_batched_tokens=512, target_itl_ms=60))
    p99 = lambda xs: sorted(xs)[int(0.99 * len(xs))]  # noqa: E731
    assert p99(fixed) > 0.2  # a 300-token prompt in one step: ~0.2 s for everyone decoding
    assert p99(slo[50:]) < 0.060 * 1.15  # after the warm-up, within the noise of the target
    assert done_slo >= 0.9 * done_fixed  # prompts still get through (smaller chunks, more steps)
