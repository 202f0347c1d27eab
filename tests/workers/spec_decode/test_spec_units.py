"""Speculative decoding pieces without a model: verification rules (greedy, and the rejection
sampler's losslessness as a statistical test), prompt lookup, the adaptive draft-length policy,
and the scheduler / block manager's handling of drafts (budget, rollback of rejected slots)."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.block_manager import BlockManager
from workers.config import SchedulerConfig
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.draft_length import DraftCost, DraftLengthPolicy, RowCost
from workers.spec_decode.ngram import NgramProposer, lookup
from workers.engine.proposer import DraftAsk
from workers.sample.rejection_sampler import accept_greedy, accept_sampled, target_probs

from testkit.tolerance import ELEMENTWISE_FP32, PROB_MASS_FP32, estimate


# ------------------------------------------------------------------ greedy rule
@pytest.mark.parametrize("argmax, draft, want", [
    ([5, 9, 7, 4], [5, 9, 2], [5, 9, 7]),  # third draft rejected, replaced
    ([5, 9, 2, 4], [5, 9, 2], [5, 9, 2, 4]),  # all accepted + bonus
    ([1, 9, 2, 4], [5, 9, 2], [1]),  # first rejected: plain decoding's token
    ([3], [], [3]),
])
def test_accept_greedy(argmax, draft, want):
    assert accept_greedy(argmax, draft) == want


# ---------------------------------------------------------- rejection sampling
def _dists(seed: int, k: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, v, generator=g) ** 3
    q = torch.rand(k, v, generator=g) ** 3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _emitted_first(p, q, k, n, seed, deterministic=False):
    """Distribution of the first emitted token over n trials, drafts drawn from q (or fixed)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    second = torch.zeros(p.shape[1])
    n_second = 0
    for _ in range(n):
        if deterministic:
            draft = [int(torch.argmax(q[i])) for i in range(k)]
            out = accept_sampled(p, draft, None, gen)
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
            out = accept_sampled(p, draft, q, gen)
        counts[out[0]] += 1
        if len(out) > 1 and out[0] == draft[0]:
            second[out[1]] += 1
            n_second += 1
    return counts / n, second, n_second


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_rejection_sampling_is_lossless(deterministic):
    """The first emitted token is distributed as p_1 whatever q is. 20,000 trials over 6 tokens:
    the standard error of each frequency is <= sqrt(.25/20000) = 0.0035, so a tolerance of 0.015
    (4+ standard errors) fails a wrong rule (which is off by 0.05-0.3 here) and passes the right one."""
    k, v = 3, 6
    p, q = _dists(0, k, v)
    freq, _, _ = _emitted_first(p, q, k, 20_000, seed=1, deterministic=deterministic)
    assert freq.tolist() == estimate(p[0].tolist(), abs=0.015, why="4+ standard errors (docstring)"), (freq, p[0])
    # the naive rule "keep the draft if it is p's argmax, else resample from p" is detectably wrong
    assert (q[0] - p[0]).abs().max().item() > 0.05


def test_rejection_sampling_second_token_follows_p2():
    """Given the first draft was accepted, the next emitted token is distributed as p_2."""
    k, v = 2, 5
    p, q = _dists(3, k, v)
    _, second, n = _emitted_first(p, q, k, 30_000, seed=2)
    assert n > 3000
    assert ((second / n) - p[1]).abs().max().item() < 4 * (0.25 / n) ** 0.5 + 0.01


def test_rejection_sampling_seeded_is_reproducible():
    p, q = _dists(5, 4, 50)
    draft = [int(torch.argmax(q[i])) for i in range(4)]
    runs = [accept_sampled(p, draft, q, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_target_probs_matches_sampler_filtering():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    assert p[0, 2:].sum() == 0 and p.sum().item() == PROB_MASS_FP32.approx(1.0)


# -------------------------------------------------------------------- ngram
@pytest.mark.parametrize("tokens, k, want", [
    ([7, 1, 2, 3, 4, 9, 1, 2], 3, [3, 4, 9]),
    ([7, 1, 2, 3, 4, 9, 1, 2], 10, [3, 4, 9, 1, 2]),  # stops at the end of the context
    ([1, 2, 3, 4], 2, []),  # nothing repeats
    ([5, 5, 5], 2, [5]),  # the newest earlier match wins
])
def test_lookup(tokens, k, want):
    assert lookup(tokens, k, 1, 3) == want


def test_lookup_prefers_the_longest_ngram():
    # "2" alone last occurred before 8; "1 2" occurred before 3
    tokens = [1, 2, 3, 0, 2, 8, 0, 1, 2]
    assert lookup(tokens, 1, 1, 2) == [3]
    assert lookup(tokens, 1, 1, 1) == [8]


def test_ngram_proposer_skips_requests_without_a_match():
    prop = NgramProposer(1, 3)
    drafts = prop.propose([DraftAsk("a", [1, 2, 3, 1, 2], 2, SamplingParams()), DraftAsk("b", [1, 2, 3], 2, SamplingParams())])
    assert set(drafts) == {"a"} and drafts["a"].token_ids == [3, 1] and drafts["a"].probs is None


# ------------------------------------------------------------------ adaptive
def _trained(draft_per_token=0.0) -> DraftLengthPolicy:
    pol = DraftLengthPolicy(k_max=6)
    for n in (1, 2, 3, 5, 7, 1, 4, 6):  # a step: 20 ms + 1 ms per token
        pol.observe_step(n, 0.020 + 0.001 * n)
    if draft_per_token:
        for k in (1, 2, 4, 6, 3):
            pol.observe_draft(k, draft_per_token * k)
    return pol


def test_adaptive_drafts_long_windows_when_they_are_accepted():
    pol = _trained()
    for _ in range(20):
        pol.observe("r", 4, 4)
    assert pol.choose("r", 10) == 6


def test_adaptive_stops_drafting_when_drafts_fail_and_probes_later():
    pol = _trained(draft_per_token=0.008)
    for _ in range(20):
        pol.observe("r", 4, 0)
    ks = [pol.choose("r", 10) for _ in range(16)]
    assert ks.count(0) == 14 and ks.count(1) == 2  # a probe every 8 steps


def test_adaptive_decodes_plainly_when_the_wait_for_drafts_costs_more_than_they_bring():
    # draft() fits the target's measured wait (an overlapped drafter's hidden work is already out of
    # it); it is charged in full, never discounted again by the step time
    cheap, dear = _trained(draft_per_token=0.002), _trained(draft_per_token=0.030)
    for pol in (cheap, dear):
        for _ in range(20):
            pol.observe("r", 4, 2)  # acceptance 0.5
    assert cheap.choose("r", 10) > 0
    assert dear.choose("r", 10) == 0  # k = 1 brings 0.5 tokens for 31 ms of a 21 ms/token decode


def test_adaptive_does_not_probe_where_even_perfect_drafts_would_not_pay():
    # as measured for the Qwen pair at batch 8 on 1 thread: a verify row costs what a decode row
    # does, and every drafter call waits ~0.15 s: no acceptance can make drafting pay (the stale
    # draft-cost re-probe, tested below, is out of the way)
    pol = DraftLengthPolicy(k_max=6, stale_after=10**6)
    for n in (8, 16, 24, 40, 8, 32, 48, 16):
        pol.observe_step(n, 0.001 + 0.020 * n)
    for k in (1, 2, 4, 6, 3):
        pol.observe_draft(k, 0.150 + 0.008 * k)
    asks = [(f"r{i}", 10, False) for i in range(8)]
    for rid, _, _ in asks:
        for _ in range(20):
            pol.observe(rid, 4, 0)
    assert [pol.choose_step(asks) for _ in range(16)] == [[0] * 8] * 16  # no probes


def test_adaptive_remeasures_a_draft_cost_that_turned_drafting_off_for_good():
    # a load spike made three rounds slow: every draft priced above a target step, no request drafts,
    # so no round ever corrects the estimate -- unless a probe re-measures it once it is stale: a
    # catch-up round (k = 1, not a sample), then the request's full window, which is the sample
    pol = DraftLengthPolicy(k_max=4, stale_after=64)
    for n in (1, 2, 3, 1, 2, 3):
        pol.observe_step(n, 0.150 + 0.005 * n)
    for _ in range(3):
        pol.observe_draft(1, 0.400)
    ks = [pol.choose(f"r{i // 40}", 10) for i in range(200)]  # five requests of 40 steps, perfect drafts
    probes = [i for i, k in enumerate(ks) if k]
    assert ks[:8] == [0] * 8 and probes
    pairs = [(probes[j], probes[j + 1]) for j in range(0, len(probes), 2)]
    assert 1 <= len(pairs) <= 200 // 64 + 1
    assert all(b == a + 1 and ks[a] == 1 and ks[b] == 4 for a, b in pairs)  # catch-up, then a full window
    for _ in range(3):  # the probes find the drafter fast now
        pol.observe_draft(4, 0.010)
        pol.observe("r9", 4, 4)
    assert pol.choose("r9", 10) > 0  # drafting again


def test_adaptive_respects_the_limit_and_switch():
    pol = _trained()
    assert pol.choose("r", 2) <= 2 and pol.choose("r", 0) == 0
    assert DraftLengthPolicy(k_max=3, adaptive=False).choose("x", 10) == 3


def test_row_cost_prices_a_row_count_from_the_steps_that_had_it():
    cost = RowCost(prior_ratio=0.05)
    assert cost(8) == 0.0  # nothing measured: free, as before the first step
    for s in (0.5, 0.5, 4.0, 0.5):  # one slow step (a load spike) does not move the median
        cost.add(8, s)
    assert cost(8) == 0.5 and cost.measured(8) and not cost.measured(40)
    # one row count seen: others follow the prior's shape (1 + 0.05 n), scaled to it
    assert cost(40) == estimate(0.5 * 3.0 / 1.4, rel=1e-12, why="float64 arithmetic of a few terms") and cost(40) < 2.0
    for _ in range(3):
        cost.add(40, 2.5)
    assert cost(24) == 1.5  # between measured counts: interpolated (8: 0.5, 40: 2.5)
    assert cost(40) == 2.5
    # beyond them: from the nearest measured count by the fitted slope (here 2 s / 32 rows)
    assert cost(48) == estimate(2.5 + cost.line.b * 8, rel=1e-12, why="float64 arithmetic of a few terms")
    assert cost.line.b > 0.0


def _simulate(policy: DraftLengthPolicy, streams: int, steps: int, acceptance: float, step_s, draft_s,
              rng: random.Random) -> tuple[float, list[list[int]]]:
    """Runs ``steps`` decode steps of ``streams`` requests the way the Speculator drives the policy
    (choose_step, the step's and the drafter's measured times, each verify's
    acceptance: every draft kept with probability ``acceptance`` until the first miss); returns
    (tokens per second, each step's choices)."""
    seconds = tokens = 0.0
    choices = []
    for _ in range(steps):
        ks = policy.choose_step([(f"r{i}", 100, False) for i in range(streams)])
        choices.append(ks)
        rows = streams + sum(ks)
        dt = step_s(rows)
        if any(ks):
            wait = draft_s(max(ks))
            policy.observe_draft(max(ks), wait, sum(1 for k in ks if k))
            dt += wait
        policy.observe_step(rows, step_s(rows))
        for i, k in enumerate(ks):
            kept = 0
            while kept < k and rng.random() < acceptance:
                kept += 1
            policy.observe(f"r{i}", k, kept)
            tokens += kept + 1
        seconds += dt
    return tokens / seconds, choices


# A target step's ms by rows shaped like Qwen2.5-Coder-1.5B q4 on one CPU thread (the curve in
# benchmarks/README.md, drafter_pool_e2e.py's section): nearly flat to 8 rows, +200 ms at 9, then
# ~16 ms a row. Between the listed counts: linear.
Q4_STEP_MS = {1: 141, 2: 144, 5: 170, 8: 196, 9: 396, 12: 422, 16: 478, 24: 636, 32: 699, 40: 835}


def _q4_step(rows: int) -> float:
    sizes = sorted(Q4_STEP_MS)
    hi = next(m for m in sizes if m >= rows)
    lo = max(m for m in sizes if m <= rows)
    ms = Q4_STEP_MS[lo] if lo == hi else Q4_STEP_MS[lo] + (rows - lo) / (hi - lo) * (Q4_STEP_MS[hi] - Q4_STEP_MS[lo])
    return ms / 1e3


def _draft_wait(k: int) -> float:  # an overlapped drafter: 5 ms + 10 ms a draft position
    return 0.005 + 0.010 * k


def test_adaptive_declines_at_8_streams_on_the_measured_q4_kernel_after_1_stream_drafted():
    # the bench's order: one stream first (drafting 4 costs ~+30 ms a step: it pays), then eight. A
    # line fitted to those steps prices a row at ~7 ms; at 8 streams a verify of 8 x 2 rows costs
    # 2.4x a plain step and 8 x 5 rows 4.3x: drafting at any depth loses (k = 4 at acceptance 0.8:
    # 0.8x), so the policy must decline.
    policy = DraftLengthPolicy(k_max=4)
    rng = random.Random(0)
    rate1, _ = _simulate(policy, 1, 100, 0.8, _q4_step, _draft_wait, rng)
    assert rate1 * _q4_step(1) >= 1.5  # 1 stream drafts: 1.5x+ of one token per plain step
    plain = 8 / _q4_step(8)
    for k in range(1, 5):  # every fixed depth loses here
        assert 8 * (1 - 0.8 ** (k + 1)) / 0.2 / (_q4_step(8 * (1 + k)) + _draft_wait(k)) < plain
    rate8, choices = _simulate(policy, 8, 200, 0.8, _q4_step, _draft_wait, rng)
    assert rate8 / plain >= 0.97  # ~1.0x
    late = [k for ks in choices[10:] for k in ks]
    assert late.count(0) / len(late) >= 0.97


def test_adaptive_drafts_alone_but_not_beside_plain_requests_past_a_kernel_tile():
    # 8 streams, one of them with drafts that are always right, the others' never: drafting 4 for
    # that one alone takes the step from 8 to 12 rows, across the 8-row tile (+226 ms): not worth
    # 3.4 tokens against a 196 ms step of 8. With 4 streams (8 rows after its 4 drafts) it is.
    for streams, want_drafts in ((8, False), (4, True)):
        policy = DraftLengthPolicy(k_max=4, stale_after=10**6)
        for n in range(streams, streams + 33):  # every size already measured
            policy.observe_step(n, _q4_step(n))
        for k in range(1, 5):
            policy.observe_draft(k, _draft_wait(k))
        for _ in range(20):
            policy.observe("good", 4, 4)
            for i in range(streams - 1):
                policy.observe(f"bad{i}", 4, 0)
        ks = policy.choose_step([("good", 10, False)] + [(f"bad{i}", 10, False) for i in range(streams - 1)])
        assert ks[1:] == [0] * (streams - 1)
        assert (ks[0] > 0) == want_drafts, (streams, ks)


def _simulate_drafter(policy: DraftLengthPolicy, streams: int, steps: int, acceptance: float, step_s, pass_s,
                      rng: random.Random, fixed_s: float = 0.002) -> tuple[float, list[list[int]]]:
    """Like _simulate, with a drafter model behind the waits: a round of n requests drafting up to
    k runs k + 1 passes (the overlap's guess) of pass_s(n) seconds each, after fixed_s; when every
    request of the previous round kept all its drafts and the guess, the round was computed during
    that step's verify and the target waits only for what is left of it (draft_model.py's overlap)."""
    seconds = tokens = 0.0
    choices: list[list[int]] = []
    hidden = 0.0  # seconds of the next round already computed during the last verify
    for _ in range(steps):
        ks = policy.choose_step([(f"r{i}", 100, False) for i in range(streams)])
        choices.append(ks)
        rows = streams + sum(ks)
        dt = step_s(rows)
        hit = True
        if any(ks):
            n = sum(1 for k in ks if k)
            wait = max(0.0, fixed_s + (max(ks) + 1) * pass_s(n) - hidden)
            policy.observe_draft(max(ks), wait, n)
            dt += wait
        policy.observe_step(rows, step_s(rows))
        for i, k in enumerate(ks):
            kept = 0
            while kept < k and rng.random() < acceptance:
                kept += 1
            hit = hit and k > 0 and kept == k and rng.random() < acceptance
            policy.observe(f"r{i}", k, kept)
            tokens += kept + 1
        hidden = step_s(rows) if hit else 0.0
        seconds += dt
    return tokens / seconds, choices


def test_a_cold_first_drafter_round_does_not_stop_drafting_at_one_stream():
    # as logged for the Qwen pair: the drafter's first measured round, a cold k = 1, waited 0.3 s
    # against a 0.14 s target step. Fitted per draft token it priced k = 4 at 1.2 s and nothing
    # drafted until a stale re-probe; priced per pass and measured for a few rounds before it decides,
    # drafting goes on and pays (a warm pass: 25 ms, a fresh k = 4 round 127 ms)
    for seed in range(3):
        policy = DraftLengthPolicy(k_max=4, extra_passes=1)
        for rows in (1, 1, 5, 5):
            policy.observe_step(rows, _q4_step(rows))
        policy.observe_draft(1, 0.300)  # the cold round
        rate, choices = _simulate_drafter(policy, 1, 100, 0.8, _q4_step, lambda n: 0.025, random.Random(seed))
        assert choices[0] == [4] and sum(1 for ks in choices if ks[0]) >= 75, seed
        assert rate * _q4_step(1) >= 1.5, seed


def test_slow_first_rounds_do_not_keep_pricing_the_drafter_once_it_is_re_measured():
    # as in drafter_pool_e2e under load (benchmarks/README.md, 2026-11-29 17:00, load 5-9): the first
    # drafter rounds (a cold drafter, the warm-up request's windows of 4 down to 1) waited ~0.8 s
    # against a ~0.15 s step, so one stream stopped drafting although its drafts were all kept. The
    # stale re-probe (after 64 steps) measures a 4-draft round at its real cost, but a mean over the
    # shape's last waits kept the slow ones: further plain steps, re-measured one probe at a time
    # (79-107 of the 130 steps after step 70 drafted, by seed). Re-measured after a drought, a shape
    # starts over, and slow shapes not measured since weigh little in the fit: every step drafts
    # after the re-probe. A drafter round here: 2 ms + 25 ms a pass, what the overlap hides is off.
    for seed in range(3):
        policy = DraftLengthPolicy(k_max=4, extra_passes=1)
        for rows in (1, 1, 5, 5):
            policy.observe_step(rows, _q4_step(rows))
        for k in (4, 4, 3, 2, 1):
            policy.observe_draft(k, 0.8)  # the cold rounds
        rng, hidden, since_drafted, choices = random.Random(seed), 0.0, 0, []
        for _ in range(200):
            [k] = policy.choose_step([("r", 100, False)])
            choices.append(k)
            rows = 1 + k
            if k:
                wait = max(0.0, 0.002 + (k + 1) * 0.025 - hidden)
                if since_drafted < 5:  # the Speculator's steady rule: a catch-up round is no sample
                    policy.observe_draft(k, wait, 1)
                since_drafted = 0
            else:
                since_drafted += 1
            policy.observe_step(rows, _q4_step(rows))
            kept = 0
            while kept < k and rng.random() < 0.95:
                kept += 1
            policy.observe("r", k, kept)
            hidden = _q4_step(rows) if k and kept == k and rng.random() < 0.95 else 0.0
        assert choices[:60] == [0] * 60, seed  # priced by the cold rounds until the stale probe ...
        assert sum(1 for k in choices[70:] if k) >= 125, (seed, choices)  # ... then drafting on


def _flat_step(rows: int) -> float:  # a GPU-like target: a step costs the same up to 64 rows
    return 0.100


def _cpu_drafter_pass(n: int) -> float:  # a CPU drafter: 4 ms a pass + 10 ms a row
    return 0.004 + 0.010 * n


def test_a_drafter_priced_per_pass_over_its_rows_declines_at_8_streams_and_drafts_again_alone():
    # verify rows are free on this target, the drafter's rows are not: at 1 stream k = 4 waits at
    # most 5 x 14 ms (2.36 tokens for 0.7 tokens' worth), at 8 streams 5 x 84 ms (18.9 tokens for
    # 33.6 tokens' worth; k = 1: 6.4 for 13.4). A wait priced per draft token per request, learnt at
    # 1 stream, is 8 rows a pass too cheap there.
    plain1, plain8 = 1 / _flat_step(1), 8 / _flat_step(8)
    for k in range(1, 5):  # every fixed depth loses at 8 streams
        assert 8 * (1 - 0.8 ** (k + 1)) / 0.2 / (_flat_step(8) + 0.002 + (k + 1) * _cpu_drafter_pass(8)) < plain8
    for seed in range(3):
        policy = DraftLengthPolicy(k_max=4, extra_passes=1)
        rng = random.Random(seed)
        rate1, _ = _simulate_drafter(policy, 1, 100, 0.8, _flat_step, _cpu_drafter_pass, rng)
        assert rate1 / plain1 >= 1.5, seed
        rate8, choices = _simulate_drafter(policy, 8, 200, 0.8, _flat_step, _cpu_drafter_pass, rng)
        # after one measured round of 8: what is left is acceptance probes now and then, a few requests
        # at a time (probes due together are priced together: they share the drafter's passes)
        assert rate8 / plain8 >= 0.94, seed
        late = [k for ks in choices[4:] for k in ks]
        assert late.count(0) / len(late) >= 0.96, seed
        assert all(sum(1 for k in ks if k) <= 3 for ks in choices[4:]), seed
        rate1_again, choices1 = _simulate_drafter(policy, 1, 50, 0.8, _flat_step, _cpu_drafter_pass, rng)
        assert rate1_again / plain1 >= 1.5 and choices1[0][0] > 0, seed  # 1 stream priced from its own rounds


def test_draft_cost_fits_a_fixed_part_and_a_pass_over_rows():
    cost = DraftCost(extra_passes=1)
    assert cost(4, 8) == 0.0  # nothing measured: free, so drafting gets measured
    for k, n in ((4, 1), (4, 1), (2, 1), (4, 8), (1, 4)):
        cost.add(k, n, 0.010 + (k + 1) * (0.004 + 0.010 * n))
    # three shapes span f, p, r: every other shape follows exactly
    for k, n in ((3, 2), (4, 16), (1, 1)):
        assert cost(k, n) == estimate(0.010 + (k + 1) * (0.004 + 0.010 * n), rel=1e-4,
                                      why="exact data; the prior rows weigh 1e-6 of it")
    for _ in range(3):  # one spiky round among a shape's own does not move its price much
        cost.add(2, 2, 0.050)
    cost.add(2, 2, 5.0)
    assert cost.measured(2, 2) and cost(2, 2) == estimate(0.050, rel=1e-12, why="mean of equal float64 values")
    one_shape = DraftCost(extra_passes=1)
    for _ in range(3):
        one_shape.add(4, 1, 0.100)
    # one shape seen: the prior puts it on the passes (f = 0) and a pass over 8 rows at 2x one over 1
    assert one_shape(1, 1) == estimate(0.040, rel=1e-3, why="the prior rows weigh 1e-6 of the data")
    assert one_shape(4, 8) == estimate(0.100 * (1 + 8 * 0.125) / (1 + 0.125), rel=1e-3,
                                       why="the prior rows weigh 1e-6 of the data")


def test_a_batch_size_with_no_plain_step_measured_decodes_plainly_once():
    policy = DraftLengthPolicy(k_max=4, stale_after=64)
    for _ in range(3):
        policy.observe_step(40, 1.7)  # only verify steps of 8 x 5 rows so far
    asks = [(f"r{i}", 10, False) for i in range(7)] + [("seeded", 10, True)]
    ks = policy.choose_step(asks)
    assert ks[:7] == [0] * 7  # this step measures step(8) ...
    assert ks[7] > 0  # ... but seeded requests decide as always (so it does not)
    assert sum(policy.choose_step(asks)[:7]) > 0  # tried already: not again so soon; drafting looks cheap
    policy.observe_step(8, 0.42)
    assert policy.choose_step(asks)[:7] == [0] * 7  # now priced: 8 x 5 rows cost 4x a plain step
    assert not policy.step.measured(4)
    assert policy.choose_step(asks[:4]) == [0] * 4  # the first step of 4: plain, to measure it


# ------------------------------------------------- scheduler and block rollback
def _running(sched: Scheduler, bm: BlockManager, n_prompt: int) -> Sequence:
    seq = Sequence("s", list(range(1, n_prompt + 1)), SamplingParams(), 0)
    sched.add(seq)
    out = sched.schedule()
    sched.commit(out)
    seq.append_token(99)  # the first sampled token
    return seq


def test_scheduler_appends_drafts_and_rolls_back_rejected_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    seq = _running(sched, bm, 6)  # 7 tokens, 6 computed: 2 blocks
    out = sched.schedule({"s": [11, 12, 13, 14, 15]})
    [c] = out.chunks
    assert c.token_ids == [99, 11, 12, 13, 14, 15] and c.num_draft == 5 and c.start_pos == 6
    assert len(bm.block_table("s")) == 3  # 12 slots for positions 0..11
    sched.commit(out, {"s": [11, 7]})  # one draft accepted, then the target's own token
    assert seq.num_computed_tokens == 8  # 99 and 11 are computed now
    assert len(bm.block_table("s")) == 2 and bm.num_free_blocks == 14  # the third block went back


def test_scheduler_cuts_drafts_to_the_budget_and_never_preempts_for_them():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4), bm)
    seq = _running(sched, bm, 6)
    out = sched.schedule({"s": list(range(20, 40))})
    assert out.chunks[0].num_draft == 5  # 1 + 5 <= 3 blocks x 4 slots - 6 computed; and the budget
    assert not out.preempted_ids
    sched.commit(out, {"s": [7]})
    assert seq.num_computed_tokens == 7 and len(bm.block_table("s")) == 2


def test_adaptive_is_timing_free_for_reproducible_requests():
    fast, slow = _trained(), DraftLengthPolicy(k_max=6)
    for n in (1, 3, 5, 7, 2, 4, 6, 8):
        slow.observe_step(n, 0.001 + 0.05 * n)  # drafts very expensive here
    for pol in (fast, slow):
        for i in range(8):
            for _ in range(5):
                pol.observe(f"r{i}", 4, 2)
    assert max(slow.choose_step([(f"r{i}", 6, False) for i in range(8)])) < fast.choose("r0", 6)  # timings matter ...
    want = fast.choose("r1", 6, reproducible=True)
    assert slow.choose_step([(f"r{i}", 6, True) for i in range(8)]) == [want] * 8  # ... except for seeded requests


# ------------------------------------------------------- verification with penalties
def test_verify_spans_applies_penalties_per_position():
    """Row j sees drafts[:j] as generated: a presence penalty rejects a draft repeating an earlier one."""
    from workers.sample.penalties import RowContext
    from workers.sample.sampler import Sampler
    from workers.sample.rejection_sampler import VerifySpan, verify_spans

    logits = torch.zeros(3, 10)
    logits[:, 3], logits[:, 4] = 1.0, 0.5  # every row prefers 3, then 4
    gen = torch.Generator().manual_seed(0)
    plain = SamplingParams(temperature=0.0, max_tokens=8, top_logprobs=1)
    penal = SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=2.0, top_logprobs=1)
    spans = [VerifySpan(0, RowContext(p, [1, 2], 2, 0), [3, 3], None, gen) for p in (plain, penal)]
    [(tokens_plain, lp_plain)] = verify_spans(Sampler(), logits, spans[:1])
    [(tokens, lps)] = verify_spans(Sampler(), logits, spans[1:])
    assert tokens_plain == [3, 3, 3]
    assert tokens == [3, 4]  # row 1 counts the first draft: 3 -> 1 - 2 < 0.5
    assert [lp.token_id for lp in lps] == [3, 4] and [t for t, _ in lps[1].top] == [4]
    want = torch.log_softmax(torch.tensor([0, 0, 0, -1.0, 0.5, 0, 0, 0, 0, 0]), -1)[4]
    assert lps[1].logprob == ELEMENTWISE_FP32.approx(float(want))
    assert [lp.token_id for lp in lp_plain] == [3, 3, 3]
