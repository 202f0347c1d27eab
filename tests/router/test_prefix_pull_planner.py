"""The router's prefix-pull planner (router/policies/prefix_pull.py): whom a chosen worker pulls a prompt
prefix from (the healthy worker holding the most of it, when that beats what the chosen worker
holds by at least min_tokens, always leaving the last prompt token to compute), forgetting workers
that left or restarted; config validation; and the pipeline putting the pull into the Submit."""

from __future__ import annotations

import asyncio

import pytest

from protos.duet.v1 import duet_pb2
from router.config import RouterConfig, RouterConfigError
from router.policies.base import PolicyConfigError, RouteRequest, WorkerState
from router.policies.prefix_pull import PrefixPullPlanner, PullSource
from router.prefix_tree import block_hashes

BS = 16


def workers(*ids: str, **kw) -> list[WorkerState]:
    return [WorkerState(w, f"{w}:1", incarnation=f"inc-{w}", **kw) for w in ids]


def req(n: int, base: int = 0) -> RouteRequest:
    return RouteRequest("r", list(range(base, base + n)))


def test_pulls_from_the_best_holder_leaving_the_last_token():
    planner = PrefixPullPlanner(min_tokens=64, block_size=BS)
    ws = workers("w0", "w1", "w2")
    assert planner.plan(req(200), "w0", ws) is None  # nobody held it; now w0 does (12 blocks)
    assert planner.plan(req(100), "w2", ws) == PullSource("w0", "w0:1", "inc-w0", 96)  # 6 blocks of w0's
    # exactly 12 blocks of prompt: 11 pulled, the 12th block (with the last token) computed
    assert planner.plan(req(192), "w1", ws) == PullSource("w0", "w0:1", "inc-w0", 176)
    assert planner.counters() == {"prefix_pulls_planned": 2, "prefix_pull_tokens_planned": 96 + 176}


def test_no_pull_when_short_held_already_or_holder_unhealthy():
    planner = PrefixPullPlanner(min_tokens=64, block_size=BS)
    ws = workers("w0", "w1")
    planner.plan(req(200), "w0", ws)
    assert planner.plan(req(40), "w1", ws) is None  # 2 blocks < min_tokens
    planner.plan(req(200), "w1", ws)  # (pulled: w1 holds it now too)
    assert planner.plan(req(200), "w1", ws) is None  # w1 holds as much as anyone
    sick = [WorkerState("w0", "w0:1", healthy=False, incarnation="inc-w0"), ws[1]]
    fresh = PrefixPullPlanner(min_tokens=64, block_size=BS)
    fresh.plan(req(200), "w0", ws)
    assert fresh.plan(req(200), "w1", sick) is None


def test_forgets_workers_that_leave_or_restart():
    planner = PrefixPullPlanner(min_tokens=16, block_size=BS)
    ws = workers("w0", "w1")
    planner.plan(req(100), "w0", ws)
    restarted = [WorkerState("w0", "w0:1", incarnation="inc-2"), ws[1]]
    assert planner.plan(req(100), "w1", restarted) is None  # w0's cache is empty now
    planner.plan(req(100, base=500), "w0", restarted)
    assert planner.plan(req(100, base=500), "w1", workers("w1")) is None  # w0 left


def test_reported_holdings_in_any_tier_name_the_holder_the_tree_forgot():
    """With the workers' reported holdings: a prefix w0 reports in its host and disk tiers (the
    tree, capped at w0's 4-block device cache, kept only 4 of its blocks) is pulled from w0 whole;
    reports in another block size are converted; a worker reporting nothing is not a holder."""
    from router.prefix_index import BlockReport, PrefixIndex
    from workers.block_hash import Tier, chain_hashes

    index = PrefixIndex()
    prompt = list(range(300))
    hashes = chain_hashes(prompt, 32)  # w0's KV blocks are 32 tokens: 9 full blocks of the prompt
    tiers = [Tier.DEVICE] * 2 + [Tier.HOST] * 4 + [Tier.DISK] * 3
    index.apply("w0", "inc-w0", BlockReport(1, True, hashes, (), [int(t) for t in tiers]), block_size=32)
    index.apply("w1", "inc-w1", BlockReport(1, True, (), ()), block_size=32)
    planner = PrefixPullPlanner(min_tokens=64, block_size=BS, holdings=index)
    ws = workers("w0", "w1", kv_blocks_total=2, kv_block_size=32)  # the tree keeps 4 blocks of 16 per worker
    planner.plan(RouteRequest("a", prompt), "w0", ws)
    assert planner.tree.match(block_hashes(prompt, BS)).get("w0", 0) == 4
    assert planner.plan(RouteRequest("b", prompt), "w1", ws) == PullSource("w0", "w0:1", "inc-w0", 288)
    blind = PrefixPullPlanner(min_tokens=64, block_size=BS)  # the tree alone
    blind.plan(RouteRequest("a", prompt), "w0", ws)
    assert blind.plan(RouteRequest("b", prompt), "w1", ws) == PullSource("w0", "w0:1", "inc-w0", 64)


def test_config_validation_names_the_field():
    with pytest.raises(PolicyConfigError, match="prefix_pull_min_tokens=0"):
        PrefixPullPlanner(min_tokens=0, block_size=BS)
    with pytest.raises(RouterConfigError, match="prefix_pull_min_tokens=-1: must be an integer >= 0"):
        RouterConfig(tokenizer_path="x", prefix_pull_min_tokens=-1)


def test_the_submit_names_the_holder(fake_pipeline):
    pipeline, directory = fake_pipeline(prefix_pull_min_tokens=32, disagg_block_size=BS)
    prompt = list(range(1000, 1100))
    pipeline.pull_planner.tree.insert("w1", [hash(tuple(prompt[i:i + BS])) for i in range(0, 96, BS)])
    request = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=prompt),
                                       sampling=duet_pb2.SamplingParams(max_tokens=3, temperature=0))

    async def go():
        return [r async for r in pipeline.generate(request)]

    assert asyncio.run(go())[-1].HasField("finish_reason")
    submitted = directory.workers["w0"].submitted[0]
    assert submitted.prefix_source.worker_id == "w1" and submitted.prefix_source.num_tokens == 96
    assert submitted.prefix_source.endpoint == "w1:1" and submitted.prefix_source.incarnation == "inc-w1"
    assert pipeline.stats()["policy"]["prefix_pulls_planned"] == 1
