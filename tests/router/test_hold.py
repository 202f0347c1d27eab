"""Holding requests while a pool wakes from zero (router/hold.py through router/pipeline.py, with the
in-memory worker directory of tests/testkit/pipeline_fakes.py): held requests are served in arrival
order once a worker joins, none is lost, the controller is asked to wake the pool once (not once
per request), the wake time is reported; a request past its deadline -- or past
router.wake_timeout_s -- gets UNAVAILABLE naming the wait. (Through a real worker and the HTTP
API's 503: tests/e2e/test_coldstart_e2e.py.)"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from protos.duet.v1 import duet_pb2
from router.hold import WakeResult, WorkerHold
from router.preprocess import RequestError

Code = grpc.StatusCode


class Controller:
    """A fake Membership/Wake: records calls, says the pool is waking."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    async def wake(self, roles) -> WakeResult:
        self.calls.append(tuple(roles))
        return WakeResult(woken=("main",), from_standby=("main",))


def request(prompt: list[int], max_tokens: int = 6) -> duet_pb2.GenerateRequest:
    return duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=prompt),
                                    sampling=duet_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))


async def collect(pipeline, req, deadline=None) -> list[int]:
    return [t async for r in pipeline.generate(req, deadline=deadline) for t in r.token_ids]


def test_held_requests_are_served_in_arrival_order_once_the_pool_wakes(fake_pipeline):
    controller, woke = Controller(), []
    hold = WorkerHold(worker_wait_s=0.3, wake_timeout_s=30.0, waker=controller.wake,
                      on_wake_s=lambda pools, s: woke.append((pools, s)))
    pipeline, directory = fake_pipeline({"w0": "colocated"}, hold=hold)
    directory.unhealthy.add("w0")  # the pool is at zero: no worker can take a request
    prompts = [[10 + i, 20, 30] for i in range(6)]

    async def scenario() -> list[list[int]]:
        tasks = []
        for p in prompts:  # arrive 20 ms apart
            tasks.append(asyncio.ensure_future(collect(pipeline, request(p))))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # held past worker_wait_s: the wake extended their wait
        assert hold.held == len(prompts) and not any(t.done() for t in tasks)
        directory.unhealthy.discard("w0")  # the woken replica joins
        return await asyncio.gather(*tasks)

    outs = asyncio.run(scenario())
    assert [list(r.prompt_token_ids) for r in directory.workers["w0"].submitted] == prompts  # in arrival order
    assert all(len(o) == 6 for o in outs)  # none lost, each complete
    assert controller.calls == [("colocated", "decode")]  # one wake for the whole episode
    assert len(woke) == len(prompts) and all(pools == ("main",) and s >= 0.5 for pools, s in woke)
    assert hold.stats()["served_after_hold"] == len(prompts) and hold.held == 0


def test_a_new_request_does_not_overtake_held_ones(fake_pipeline):
    hold = WorkerHold(worker_wait_s=5.0, wake_timeout_s=5.0)
    pipeline, directory = fake_pipeline({"w0": "colocated"}, hold=hold)
    directory.unhealthy.add("w0")

    async def scenario() -> None:
        first = asyncio.ensure_future(collect(pipeline, request([1, 2, 3])))
        await asyncio.sleep(0.1)
        directory.unhealthy.discard("w0")  # back: the held request goes first, then the newcomer
        second = asyncio.ensure_future(collect(pipeline, request([4, 5, 6])))
        await asyncio.gather(first, second)

    asyncio.run(scenario())
    assert [list(r.prompt_token_ids) for r in directory.workers["w0"].submitted] == [[1, 2, 3], [4, 5, 6]]


def test_a_held_request_past_its_deadline_gets_unavailable_naming_the_wait(fake_pipeline):
    controller = Controller()
    hold = WorkerHold(worker_wait_s=0.1, wake_timeout_s=30.0, waker=controller.wake)
    pipeline, directory = fake_pipeline({"w0": "colocated"}, hold=hold)
    directory.unhealthy.add("w0")
    started = time.monotonic()
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request([1, 2, 3]), deadline=started + 1.0))
    assert info.value.code is Code.UNAVAILABLE
    message = info.value.message
    assert re.search(r"held 0\.[6-9] s while pool\(s\) main woke from zero, until the request's deadline", message), message
    assert 0.7 <= time.monotonic() - started < 1.0  # answered before the deadline, not after it
    assert hold.stats()["hold_timed_out"] == 1 and hold.held == 0


def test_the_wake_timeout_bounds_the_hold(fake_pipeline):
    hold = WorkerHold(worker_wait_s=0.1, wake_timeout_s=0.5, waker=Controller().wake)
    pipeline, directory = fake_pipeline({"w0": "colocated"}, hold=hold)
    directory.unhealthy.add("w0")
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request([1, 2, 3])))
    assert info.value.code is Code.UNAVAILABLE
    assert "woke from zero, until router.wake_timeout_s=0.5 s" in info.value.message, info.value.message


def test_without_a_pool_to_wake_the_hold_is_worker_wait_s(fake_pipeline):
    async def nothing_sleeps(roles) -> WakeResult:
        return WakeResult()

    hold = WorkerHold(worker_wait_s=0.2, wake_timeout_s=30.0, waker=nothing_sleeps)
    pipeline, directory = fake_pipeline({"w0": "colocated"}, hold=hold)
    directory.unhealthy.add("w0")
    started = time.monotonic()
    with pytest.raises(RequestError) as info:
        asyncio.run(collect(pipeline, request([1, 2, 3])))
    assert time.monotonic() - started < 1.0
    assert "until router.worker_wait_s=0.2 s" in info.value.message, info.value.message
