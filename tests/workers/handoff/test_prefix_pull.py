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
from workers.handoff.prefix_pull import PrefixMissing, PrefixPull
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
