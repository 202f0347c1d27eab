"""Prefix pull (workers/handoff/prefix_pull.py) on a tiny random Llama with a 2,000-token shared prefix.

Engine level (the cheap core, the tensor handed over in process): a second engine that pulls the
prefix's blocks from the first produces exactly the tokens the first computed from scratch, greedy
and seeded, also when it already holds part of the prefix; a released reservation and an evicted
prefix leave nothing behind. Service level (two workers in this process, the shared-memory
transport between them): a Submit with ``prefix_source`` pulls, serves the prompt from the pulled
blocks with the same tokens, and shows up in both workers' GetLoad; a holder that lacks the prefix
or cannot be reached makes the request compute its prompt instead (same tokens, a counted
failure, no block left held)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from workers.build import build_engine
from workers.engine.engine import Engine
from workers.llm import engine_config
from workers.handoff.prefix_pull import PrefixMissing, PrefixPull, PullStats, _Pending
from workers.kv.tiers.block_file import BlockRefused
from workers.sampling_params import SamplingParams
from workers.server.service import start_worker_server

BS = 16
PREFIX_TOKENS = 2000  # 125 blocks
SMALL = dict(block_size=BS, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                               vocab_size=49152)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    for f in smollm2_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = prompt(0, PREFIX_TOKENS)
QUESTIONS = [prompt(1, 37), prompt(2, 5)]


def generate(engine: Engine, rid: str, ids: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """-> (tokens, prompt tokens served from the prefix cache)."""
    engine.add_request(rid, ids, params)
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return tokens, cached


def all_free(engine: Engine) -> bool:
    s = engine.block_manager.stats()
    return s.num_free_blocks == s.num_blocks


PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=11, ignore_eos=True)]


@pytest.fixture(scope="module")
def holder(tiny_llama) -> tuple[Engine, list[list[int]]]:
    """An engine that computed PREFIX + each question from scratch, and those tokens."""
    engine = build_engine(engine_config(str(tiny_llama), **SMALL))
    return engine, [generate(engine, f"h{i}", PREFIX + QUESTIONS[i], p)[0] for i, p in enumerate(PARAMS)]


@pytest.mark.parametrize("held_blocks", [0, 60])
def test_pulled_prefix_gives_the_recomputed_tokens(tiny_llama, holder, held_blocks):
    holder, want = holder
    puller = build_engine(engine_config(str(tiny_llama), **SMALL))
    pull = PrefixPull(None, None, BS, 5.0)  # engine-thread halves only: called directly here
    if held_blocks:  # the puller already holds the first 60 blocks: only the rest travels
        generate(puller, "warm", PREFIX[: held_blocks * BS] + [7], PARAMS[0])
    for i, p in enumerate(PARAMS):
        reserved = pull._reserve(puller, f"pull/{i}", PREFIX, "")
        if i == 0:
            assert reserved == (held_blocks, PREFIX_TOKENS // BS - held_blocks)
            kv = PrefixPull._export(holder, PREFIX, reserved[0])  # [L, 2, n, bs, G, D]
            assert kv.shape[2] == reserved[1]
            assert pull._install(puller, "pull/0", kv) == reserved[1]
        else:
            assert reserved is None  # installed by the first pull: nothing left to pull
        got, cached = generate(puller, f"p{i}", PREFIX + QUESTIONS[i], p)
        assert got == want[i]
        assert cached == PREFIX_TOKENS  # the whole prefix came from the cache, only the question was computed
    assert all_free(puller) and all_free(holder) and not pull._reserved


def test_released_reservation_and_evicted_prefix_leave_nothing(tiny_llama):
    engine = build_engine(engine_config(str(tiny_llama), **SMALL))
    pull = PrefixPull(None, None, BS, 5.0)
    assert pull._reserve(engine, "pull/x", PREFIX, "") == (0, PREFIX_TOKENS // BS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - PREFIX_TOKENS // BS
    pull._release(engine, "pull/x")
    assert all_free(engine) and not pull._reserved
    missing = PrefixPull._export(engine, PREFIX, 0)
    assert isinstance(missing, PrefixMissing) and "holds 0 of the prefix's 125 blocks" in str(missing)


def export_now(engine: Engine, tokens: list[int], first_block: int, stats: PullStats | None = None):
    """The holder's export as the service runs it, the disk reads awaited here."""
    kv = PrefixPull._export(engine, tokens, first_block, "", stats)
    if isinstance(kv, _Pending):
        kv = asyncio.run(asyncio.wait_for(kv.gather(), 30))
    return kv


TIERS = {"host": dict(host_tier_bytes=8 << 20),  # room for every block the fillers push out
         "host+disk": dict(host_tier_bytes=256 << 10, disk_tier_bytes=64 << 20)}  # most of them go to disk


@pytest.mark.parametrize("tiers", list(TIERS))
def test_a_prefix_the_holder_evicted_to_its_lower_tiers_is_pulled_from_them(tiny_llama, holder, tiers, tmp_path):
    """Issue 34 item 4, across nodes: the holder's device cache evicted the prefix into host memory
    (and disk); the pull reads it from there, verified, and the puller's greedy and seeded tokens
    equal those of computing the whole prompt."""
    _, want = holder
    extra = dict(TIERS[tiers], disk_tier_dir=str(tmp_path)) if "disk_tier_bytes" in TIERS[tiers] else TIERS[tiers]
    source = build_engine(engine_config(str(tiny_llama), **(SMALL | dict(num_blocks=200) | extra)))
    generate(source, "s", PREFIX + QUESTIONS[0], PARAMS[0])
    for i in range(2):  # 2 x 125 blocks of other prompts through a 200-block cache: the prefix goes below
        generate(source, f"filler{i}", prompt(50 + i, PREFIX_TOKENS) + [7], PARAMS[0])
    total = PREFIX_TOKENS // BS
    on_device = len(source.block_manager.cached_prefix(PREFIX))
    assert on_device < total
    stats = source.tiers.stats()
    assert (stats.disk_blocks > 0) == (tiers == "host+disk")
    puller = build_engine(engine_config(str(tiny_llama), **SMALL))
    pull = PrefixPull(None, None, BS, 5.0)
    reserved = pull._reserve(puller, "pull/t", PREFIX, "")
    assert reserved == (0, total)
    served = PullStats()
    kv = export_now(source, PREFIX, 0, served)
    assert isinstance(kv, torch.Tensor) and kv.shape[2] == total
    assert served.tier_blocks_served == total - on_device
    assert pull._install(puller, "pull/t", kv) == total
    for i, p in enumerate(PARAMS):
        got, cached = generate(puller, f"p{i}", PREFIX + QUESTIONS[i], p)
        assert got == want[i]  # the tokens of recomputing the prompt
        assert cached == PREFIX_TOKENS
    assert source.tiers.stats().refused_corrupt == 0
    source.close()
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_block_on_the_holders_disk_fails_the_pull(tiny_llama, tmp_path):
    source = build_engine(engine_config(str(tiny_llama), **(SMALL | dict(
        num_blocks=200, host_tier_bytes=256 << 10, disk_tier_bytes=64 << 20, disk_tier_dir=str(tmp_path)))))
    generate(source, "s", PREFIX + QUESTIONS[0], PARAMS[0])
    for i in range(2):
        generate(source, f"filler{i}", prompt(50 + i, PREFIX_TOKENS) + [7], PARAMS[0])
    disk = source.tiers.store.disk
    disk._pool.submit(lambda: None).result()  # the writes queued so far are done
    files = sorted(disk.dir.glob("*.kvb"))
    assert files
    for f in files:  # flip a byte of every block on disk
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    kv = PrefixPull._export(source, PREFIX, 0)
    assert isinstance(kv, _Pending) and kv.waiting
    with pytest.raises(BlockRefused):  # never sent: the service answers FAILED_PRECONDITION, the puller recomputes
        asyncio.run(asyncio.wait_for(kv.gather(), 30))
    source.close()


# ---------------------------------------------------------------------- through the service
def run(loop, coro, timeout: float = 120):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def workers(loop, tiny_llama):
    config = engine_config(str(tiny_llama), **SMALL)
    servers = [run(loop, start_worker_server(config, worker_id=f"w{i}", kv_transfer_timeout_s=5)) for i in range(2)]
    yield servers
    for s in servers:
        run(loop, s.stop(grace=1))


async def submit(server, rid: str, ids: list[int], source: worker_pb2.PrefixSource | None = None):
    request = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, prefix_source=source,
                                       sampling=worker_pb2.SamplingParams(max_tokens=8, temperature=0, top_p=1,
                                                                          ignore_eos=True))
    async with grpc.aio.insecure_channel(server.endpoint) as channel:
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Submit(request)]
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage


async def load(server) -> worker_pb2.LoadReport:
    async with grpc.aio.insecure_channel(server.endpoint) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())


def source(server, num_tokens: int = PREFIX_TOKENS, **kw) -> worker_pb2.PrefixSource:
    fields = dict(worker_id=server.worker_id, endpoint=server.endpoint, incarnation=server.incarnation,
                  num_tokens=num_tokens) | kw
    return worker_pb2.PrefixSource(**fields)


def test_second_worker_serves_the_shared_prefix_by_pulling(loop, workers):
    holder, puller = workers
    ids = PREFIX + QUESTIONS[0]
    want, _ = run(loop, submit(holder, "a", ids))  # computed from scratch on the holder
    got, usage = run(loop, submit(puller, "b", ids, source(holder)))
    assert got == want and usage.cached_prompt_tokens == PREFIX_TOKENS
    h, p = run(loop, load(holder)), run(loop, load(puller))
    assert (p.prefix_pulls, p.prefix_pull_blocks, p.prefix_pull_failures) == (1, PREFIX_TOKENS // BS, 0)
    assert p.prefix_pull_bytes > 0 and p.kv_bytes_received == p.prefix_pull_bytes
    assert h.prefix_pulls_served == 1 and h.kv_bytes_sent == p.prefix_pull_bytes
    assert h.kv_blocks_used == p.kv_blocks_used == 0


@pytest.mark.parametrize("case", ["holder lacks it", "holder unreachable", "holder restarted", "bad length"])
def test_a_failed_pull_computes_the_prompt_instead(loop, workers, case):
    holder, puller = workers
    ids = prompt(10 + len(case), 300) + QUESTIONS[1]  # nobody holds this prefix
    src = {"holder lacks it": source(holder, 288), "holder unreachable": source(holder, 288, endpoint="127.0.0.1:1"),
           "holder restarted": source(holder, 288, incarnation="old"), "bad length": source(holder, 100)}[case]
    before = run(loop, load(puller)).prefix_pull_failures
    got, usage = run(loop, submit(puller, f"got-{case}", ids, src))
    want, _ = run(loop, submit(holder, f"want-{case}", ids))  # after: the holder lacked the prefix above
    assert got == want and usage.cached_prompt_tokens == 0
    after = run(loop, load(puller))
    assert after.prefix_pull_failures == before + 1 and after.kv_blocks_used == 0


def test_a_holder_serves_a_pull_from_its_disk_tier_through_the_service(loop, tiny_llama, holder, tmp_path):
    """The service path (PullPrefix, shm transport): the holder's prefix is mostly on its disk tier;
    the pull awaits those reads off its engine thread and the puller's tokens equal recomputing."""
    _, want = holder
    tiered = engine_config(str(tiny_llama), **(SMALL | dict(
        num_blocks=200, host_tier_bytes=256 << 10, disk_tier_bytes=64 << 20, disk_tier_dir=str(tmp_path))))
    servers = [run(loop, start_worker_server(c, worker_id=f"t{i}", kv_transfer_timeout_s=5))
               for i, c in enumerate([tiered, engine_config(str(tiny_llama), **SMALL)])]
    try:
        src, puller = servers
        run(loop, submit(src, "s", PREFIX + QUESTIONS[0]))
        for i in range(2):  # the prefix leaves src's device cache, mostly for its disk tier
            run(loop, submit(src, f"filler{i}", prompt(50 + i, PREFIX_TOKENS) + [7]))
        assert run(loop, load(src)).tier_disk_bytes > 0
        got, usage = run(loop, submit(puller, "p", PREFIX + QUESTIONS[0], source(src)))
        assert got == want[0] and usage.cached_prompt_tokens == PREFIX_TOKENS
        h, p = run(loop, load(src)), run(loop, load(puller))
        assert h.prefix_pulls_served == 1 and h.prefix_pull_tier_blocks_served > 0
        assert p.prefix_pulls == 1 and p.prefix_pull_failures == 0
    finally:
        for s in servers:
            run(loop, s.stop(grace=1))
    assert list(tmp_path.iterdir()) == []
