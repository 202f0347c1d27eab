"""Scheduler (no model): token budget, chunked prefill around decodes, preemption, no starvation."""

import random

from workers.engine.block_manager import BlockManager
from workers.config import SchedulerConfig
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import Sequence, SequenceStatus


def make(budget: int, num_blocks: int, block_size: int = 4, max_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def fake_step(sched: Scheduler, out: SchedulerOutput, max_tokens: dict[str, int]) -> list[Sequence]:
    """What the engine does after the runner: commit, append a token where sampled, finish."""
    sched.commit(out)
    finished = []
    by_id = {s.request_id: s for s in sched.running}
    for c in out.chunks:
        if c.sample:
            s = by_id[c.request_id]
            s.append_token(7)
            if s.num_output_tokens >= max_tokens[s.request_id]:
                sched.remove(s)
                s.status = SequenceStatus.FINISHED
                finished.append(s)
    return finished


def test_budget_respected_and_everything_finishes():
    rng = random.Random(0)
    sched = make(budget=32, num_blocks=64)
    max_tokens = {}
    for i in range(20):
        rid = f"r{i}"
        sched.add(Sequence(rid, [rng.randrange(100) for _ in range(rng.randrange(1, 80))], SamplingParams(), i))
        max_tokens[rid] = rng.randrange(1, 20)
    done = []
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert 0 < out.num_tokens <= 32
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        done += fake_step(sched, out, max_tokens)
    assert len(done) == 20
    assert sched.block_manager.num_free_blocks == 64


def test_long_prompt_is_chunked_around_running_decodes():
    sched = make(budget=16, num_blocks=64)
    for i in range(4):
        sched.add(Sequence(f"d{i}", [1, 2, 3], SamplingParams(), i))
    max_tokens = {f"d{i}": 100 for i in range(4)} | {"long": 1}
    fake_step(sched, sched.schedule(), max_tokens)  # prefill the 4 short prompts
    sched.add(Sequence("long", list(range(100)), SamplingParams(), 9))
    steps_with_long = 0
    while any(s.request_id == "long" for s in list(sched.waiting) + sched.running):
        out = sched.schedule()
        ids = [c.request_id for c in out.chunks]
        assert ids[:4] == ["d0", "d1", "d2", "d3"], ids  # every decode, every step, first
        assert out.num_tokens <= 16
        if "long" in ids:
            steps_with_long += 1
            assert len(out.chunks[-1].token_ids) <= 12
        fake_step(sched, out, max_tokens)
    assert steps_with_long == -(-100 // 12)  # 12 prompt tokens per step next to 4 decodes


def test_preempts_newest_and_resumes():
    # 6 blocks of 4 tokens: two 8-token prompts fit, but not their growth to 16 tokens each.
    sched = make(budget=64, num_blocks=6)
    a = Sequence("a", list(range(8)), SamplingParams(), 0)
    b = Sequence("b", list(range(50, 58)), SamplingParams(), 1)
    sched.add(a)
    sched.add(b)
    max_tokens = {"a": 8, "b": 8}
    preempted = []
    done = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        preempted += out.preempted_ids
        done += fake_step(sched, out, max_tokens)
    assert preempted and set(preempted) == {"b"}  # only the newer request is ever preempted
    assert [s.request_id for s in done] == ["a", "b"]
    assert b.num_preemptions >= 1 and b.num_output_tokens == 8
    assert sched.block_manager.num_free_blocks == 6


def test_max_num_seqs_and_fifo_admission():
    sched = make(budget=64, num_blocks=64, max_seqs=2)
    for i in range(4):
        sched.add(Sequence(f"r{i}", [i, i, i], SamplingParams(), i))
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]


def test_sliding_window_releases_blocks_before_the_window():
    """window 6, block 4: at every step the held blocks cover the next query's window (and its
    chunk); everything is freed at the end, and exported requests keep every block."""
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8)
    bm = BlockManager(32, 4)
    sched = Scheduler(cfg, bm, window=6)
    a = Sequence("a", list(range(21)), SamplingParams(), 0)
    b = Sequence("b", list(range(50, 71)), SamplingParams(), 1)
    sched.add(a)
    sched.add(b)
    sched.keep_all_blocks("b")
    max_tokens = {"a": 30, "b": 30}
    while sched.has_unfinished():
        out = sched.schedule()
        for c in out.chunks:  # a chunk's window starts at start_pos - 5: blocks from there are held
            if c.request_id == "a":
                dropped = len(c.block_table) - bm.num_held_blocks("a")
                assert dropped == max(0, c.start_pos - 5) // 4
        finished = fake_step(sched, out, max_tokens)
        if a.status is SequenceStatus.RUNNING:
            assert bm.num_held_blocks("a") <= (6 + 8) // 4 + 1
        if b.status is SequenceStatus.RUNNING:
            assert bm.num_held_blocks("b") == len(bm.block_table("b"))
        assert all(s.request_id in max_tokens for s in finished)
    assert bm.num_free_blocks == 32
