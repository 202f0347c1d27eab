"""Pushed block events (router/block_watch.py, workers/server/block_watch.py) against the polled ones:
with a load poll far longer than the test, a router learns a prefix another router sent within
milliseconds through the worker's WatchBlocks stream; the poll-only path (watch_block_events off)
ends with the same index, one poll later; a worker without WatchBlocks is fed by the poll."""

from __future__ import annotations

import grpc
import pytest
from testkit.router_fakes import LoopThread, router_config, wait_until

from cluster.bench.echo_worker import EchoWorker, start_echo_worker
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.server import serve_router
from workers.block_hash import chain_hashes

PROMPT = list(range(1000, 1064))  # 4 blocks of 16


class _NoWatchWorker(EchoWorker):
    """An echo worker from before WatchBlocks (or without prefix caching)."""

    async def WatchBlocks(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no block events pushed here")
        yield  # pragma: no cover


@pytest.fixture
def echo_workers():
    lt = LoopThread()
    workers = [EchoWorker(first_token_ms=5, gap_ms=1), _NoWatchWorker(first_token_ms=5, gap_ms=1)]
    servers = [lt.run(start_echo_worker(worker=w)) for w in workers]
    try:
        yield [(f"e{i}", f"127.0.0.1:{port}") for i, (_, port) in enumerate(servers)]
    finally:
        for server, _ in servers:
            lt.run(server.stop(0))
        lt.close()


def _generate(address: str, ids: list[int]) -> None:
    with grpc.insecure_channel(address) as channel:
        req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=ids),
                                       sampling=duet_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
        list(duet_pb2_grpc.DuetStub(channel).Generate(req, timeout=30))


def test_a_pushed_prefix_reaches_the_other_router_long_before_its_poll(echo_workers, smollm2_path, tok):
    e0 = echo_workers[:1]
    # polls 60 s apart: after the first one (on joining), only the push can tell them anything
    sender, watcher, poller = (serve_router(router_config(smollm2_path, policy="prefix_aware", load_poll_interval_s=60.0,
                                                          watch_block_events=watch), e0, tokenizer=tok)
                               for watch in (True, True, False))
    try:
        wait_until(lambda: watcher.server.directory.snapshot()[0].healthy, what="e0 routable")
        _generate(sender.address, PROMPT)
        n = len(PROMPT) // 16
        wait_until(lambda: watcher.server.prefix_index.match(PROMPT) == {"e0": n}, timeout=2.0,
                   what="the watching router sees e0 hold the prefix")
        assert poller.server.prefix_index.match(PROMPT) == {}  # the poll-only router: not before its next poll
        assert watcher.server.directory.num_block_watch_unsupported == 0
    finally:
        for r in (sender, watcher, poller):
            r.stop(0)


def test_watched_and_polled_indexes_agree_and_a_worker_without_watch_is_polled(echo_workers, smollm2_path, tok):
    routers = [serve_router(router_config(smollm2_path, policy="round_robin", load_poll_interval_s=0.05,
                                          watch_block_events=watch), echo_workers, tokenizer=tok)
               for watch in (True, False)]
    try:
        wait_until(lambda: all(w.healthy for r in routers for w in r.server.directory.snapshot()), what="routable")
        prompts = [[7000 + i] * 16 + PROMPT[: 16 * (1 + i % 4)] for i in range(8)]
        for i, p in enumerate(prompts):
            _generate(routers[i % 2].address, p)  # round robin: both workers get prompts
        index_of = [r.server.prefix_index for r in routers]
        # both feeds settle on the same holdings (each index fills at its own pace: the pushed one at
        # once, the polled one at its next poll of each worker), then every prompt matches alike
        # (a prompt's blocks show as pending until its first token, as computed after)
        wait_until(lambda: all(index_of[0].num_blocks(w) == index_of[1].num_blocks(w) > 0 for w in ("e0", "e1"))
                   and all(index_of[0].match_tiers(p) == index_of[1].match_tiers(p)
                           and sum(index_of[0].match(p).values()) == len(chain_hashes(p, 16)) for p in prompts),
                   timeout=10.0, what="both indexes filled alike, every prompt computed")
        for p in prompts:  # the same holdings, whichever feed brought them
            assert index_of[0].match_tiers(p) == index_of[1].match_tiers(p), p
            assert sum(index_of[0].match(p).values()) == len(chain_hashes(p, 16))
        watched = routers[0].server.directory
        assert watched.num_block_watch_unsupported == 1  # e1, told once; its holdings came from the poll
    finally:
        for r in routers:
            r.stop(0)


def test_the_watch_reopens_on_a_restarted_worker_and_takes_its_new_holdings(smollm2_path, tok):
    lt = LoopThread()
    server, port = lt.run(start_echo_worker(worker=EchoWorker(first_token_ms=5)))
    router = serve_router(router_config(smollm2_path, policy="prefix_aware", load_poll_interval_s=0.2),
                          [("e0", f"127.0.0.1:{port}")], tokenizer=tok)
    try:
        directory, index = router.server.directory, router.server.prefix_index
        _generate(router.address, PROMPT)
        wait_until(lambda: index.match(PROMPT) == {"e0": 4}, what="the first incarnation's holdings")
        lt.run(server.stop(0))
        restarted = EchoWorker(first_token_ms=5)  # a new incarnation, empty cache, same endpoint
        server, _ = lt.run(start_echo_worker(port=port, worker=restarted))
        watch = directory._members["e0"].block_watch
        assert watch is not None
        wait_until(lambda: watch.num_reconnects >= 1 and watch.watching, timeout=10, what="the watch reopened")
        other = [2000 + i for i in range(32)]
        wait_until(lambda: directory.snapshot()[0].healthy, timeout=10, what="e0 routable again")
        _generate(router.address, other)
        wait_until(lambda: index.match(other) == {"e0": 2}, timeout=5, what="the new incarnation's holdings")
        assert index.match(PROMPT) == {} and index.cursor("e0")[1] == restarted.incarnation
    finally:
        router.stop(0)
        lt.run(server.stop(0))
        lt.close()
