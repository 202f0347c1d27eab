"""Gang execution of one engine over several ranks (expert, tensor and sequence parallelism): rank 0
(the *leader*) owns the scheduler, sampling and detokenizing; every rank owns a model runner (its
share of the experts, of every layer under TP, of long prompt chunks under SP) and runs the same
forward pass each step.

Per step the leader broadcasts one ``GangMessage`` -- the step's SchedulerOutput (lists: token ids,
positions, block tables), not tensors -- and then every rank runs it (``runner.follow``); the
layers' collectives (MoE all-to-all, TP all-reduce, SP ring) keep the ranks in lock step. Only the
leader samples (under TP the followers join the LM head's gather of the sampled rows' logits).
Between steps the leader may broadcast new expert placements (rebalancing), which every rank
applies before the next step, so no request is dropped or recomputed.

KV blocks (disaggregated prefill/decode): the gang presents itself as one runner holding every kv
head. Under TP each rank caches only its heads (workers/parallel/sharding.py ``attention_shard``);
EP and SP ranks of the same tp index hold the same heads (attention is replicated across them). So
  read_blocks   the leader broadcasts ``read_blocks`` and each rank of its own tp group that holds a
                distinct head range sends that shard to the leader, point to point over the gang
                group; the leader assembles model-wide K/V [L, 2, n, bs, G, D]. With tp_size 1 the
                leader's own cache already holds every head: no message at all.
  write_blocks  the leader broadcasts ``write_blocks`` and sends every other rank exactly its heads'
                slice of the model-wide K/V; each rank writes its slice into its own cache.
The wire between two workers (workers/kv/transfer.py) then carries model-wide heads, so the two
sides of a transfer may split heads differently (TP=2 prefill -> TP=1 decode, and so on): each
side's gang gathers or scatters its own split.

Worked example (every rank)::

    init_parallel_groups(ParallelConfig(tp_size=W), rank, init_method)
    runner = ModelRunner.from_config(config)      # this rank's shard of the model and KV cache
    if rank == 0:
        gang = GangRunner(runner, get_group("gang"))
        engine = build_engine(config, runner=gang)   # injected at construction
        ... drive engine.step() as usual ...
        gang.stop()
    else:
        follow(runner, get_group("gang"))          # returns when the leader stops

Failure: a dead rank makes the next collective raise on every other rank (gloo sees the closed
connection; a stuck peer hits the process group's timeout), so a gang fails fast rather than hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from workers.engine.model_runner import ModelRunner
from workers.models.config import ModelSpec
from workers.parallel import comm
from workers.parallel.eplb import Rebalancer
from workers.parallel.expert_placement import ExpertPlacement
from workers.parallel.groups import GroupCoordinator, get_group
from workers.parallel.sharding import Shard, attention_shard
from workers.engine.runner import KVLayout, MoEStats, RunnerOutput
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import SchedulerOutput
from workers.engine.proposer import Draft
from workers.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GangMessage:
    """One control message from the leader: a step to run, new placements to apply, KV blocks to
    read (gather to the leader) or write (scatter from the leader), or stop. Lists, not tensors: the
    KV itself follows point to point. Followers wait for it on the "gang" group, whose timeout is
    long (the leader may idle for hours between requests); a dead leader still fails the wait at once."""

    sched: SchedulerOutput | None = None
    placements: list[ExpertPlacement] | None = None
    read_blocks: list[int] | None = None
    write_blocks: list[int] | None = None
    stop: bool = False


def apply_placements(model, placements: list[ExpertPlacement]) -> None:
    """Switch every MoE layer to its new placement (collective: weights move from home ranks)."""
    for layer, placement in zip(model.moe_layers(), placements):
        layer.set_placement(placement)


def rank_kv_heads(spec: ModelSpec, gang_rank: int) -> Shard:
    """The kv heads gang rank ``gang_rank`` caches: its tp index's shard (tp is the innermost mesh
    axis, so the tp index is gang_rank % tp_size; ep and sp ranks replicate attention)."""
    tp = get_group("tp").world_size
    return attention_shard(spec.num_heads, spec.num_kv_heads, tp, gang_rank % tp).kv_heads


def head_sources(spec: ModelSpec) -> list[tuple[int, Shard]]:
    """(gang rank, heads) whose shards together hold every kv head once: the leader's tp group
    (gang ranks 0..tp-1), skipping ranks that replicate a head an earlier one holds (tp > kv heads)."""
    out: list[tuple[int, Shard]] = []
    for r in range(get_group("tp").world_size):
        heads = rank_kv_heads(spec, r)
        if not out or heads.start >= out[-1][1].end:
            out.append((r, heads))
    assert sum(h.size for _, h in out) == spec.num_kv_heads, out
    return out


def _heads(kv: torch.Tensor, heads: Shard) -> torch.Tensor:
    return kv[:, :, :, :, heads.start : heads.end].contiguous()  # [L, 2, n, bs, g, D]


class GangRunner:
    """The leader's runner (workers.engine.runner.Runner): broadcasts each step, then runs it like a
    ModelRunner; reads and writes model-wide KV blocks by gathering and scattering the ranks' head
    shards (see the module docstring). The leader alone samples, so sampling state lives here."""

    def __init__(self, runner: ModelRunner, group: GroupCoordinator, rebalancer: Rebalancer | None = None) -> None:
        assert group.rank == 0, "the gang's leader is gang rank 0"
        self.inner = runner
        self.group = group
        self.rebalancer = rebalancer
        self.spec = runner.spec
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks

    @property
    def model(self):
        return self.inner.model

    def add_request(self, request_id: str, params: SamplingParams, token_ids: list[int], num_prompt: int,
                    output_start: int | None = None, matcher: GrammarMatcher | None = None) -> None:
        self.inner.add_request(request_id, params, token_ids, num_prompt, output_start, matcher)

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)

    def generator_state(self, request_id: str) -> bytes | None:
        return self.inner.generator_state(request_id)

    def set_generator_state(self, request_id: str, state: bytes) -> None:
        self.inner.set_generator_state(request_id, state)

    def kv_layout(self) -> KVLayout:
        return self.inner.kv_layout().whole()  # the gang holds every head between its ranks

    def moe_stats(self) -> MoEStats:
        return self.inner.moe_stats()  # the leader's counters (every rank routes the same tokens)

    def execute(self, sched: SchedulerOutput, drafts: Mapping[str, Draft] | None = None) -> RunnerOutput:
        """drafts only matter to sampling, which the leader alone does: they are not broadcast."""
        if self.rebalancer is not None:
            plans = self.rebalancer.maybe_plan()
            if plans is not None:
                self.rebalance(plans)
        comm.broadcast_object(GangMessage(sched=sched), 0, self.group)
        return self.inner.execute(sched, drafts)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Model-wide K/V of the blocks [L, 2, n, bs, G, D], gathered from the ranks' head shards."""
        sources = head_sources(self.spec)
        if len(sources) == 1:  # tp_size 1: the leader's cache holds every head
            return self.inner.read_blocks(block_ids)
        comm.broadcast_object(GangMessage(read_blocks=list(block_ids)), 0, self.group)
        own = self.inner.read_blocks(block_ids)  # [L, 2, n, bs, g0, D]
        L, two, n, bs, _, D = own.shape
        out = own.new_empty(L, two, n, bs, self.spec.num_kv_heads, D)
        for rank, heads in sources:
            if rank == 0:
                part = own
            else:
                part = comm.recv_tensor(own.new_empty(L, two, n, bs, heads.size, D), rank, self.group)
            out[:, :, :, :, heads.start : heads.end] = part
        return out

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write model-wide kv [L, 2, n, bs, G, D]: every rank gets exactly its heads' slice."""
        assert kv.shape[4] == self.spec.num_kv_heads, "write_blocks takes every kv head"
        kv = kv.to(device=self.inner.device, dtype=self.inner.kv_cache.dtype)
        if self.group.world_size > 1:
            comm.broadcast_object(GangMessage(write_blocks=list(block_ids)), 0, self.group)
            for rank in range(1, self.group.world_size):
                comm.send_tensor(_heads(kv, rank_kv_heads(self.spec, rank)), rank, self.group)
        self.inner.write_blocks(block_ids, _heads(kv, self.inner.kv_heads))

    def rebalance(self, placements: list[ExpertPlacement]) -> None:
        comm.broadcast_object(GangMessage(placements=placements), 0, self.group)
        apply_placements(self.inner.model, placements)
        logger.info("applied new expert placements (%d replicas in all)",
                    sum(len(r) - 1 for p in placements for r in p.replicas))

    def stop(self) -> None:
        comm.broadcast_object(GangMessage(stop=True), 0, self.group)


def follow(runner: ModelRunner, group: GroupCoordinator) -> int:
    """A follower's loop: obey each message the leader broadcasts until it says stop. Returns the
    number of steps run. Raises (RuntimeError from the collective) if a peer dies."""
    steps = 0
    while True:
        msg: GangMessage = comm.broadcast_object(None, 0, group)
        if msg.stop:
            return steps
        if msg.placements is not None:
            apply_placements(runner.model, msg.placements)
        if msg.read_blocks is not None and any(r == group.rank for r, _ in head_sources(runner.spec)):
            comm.send_tensor(runner.read_blocks(msg.read_blocks), 0, group)
        if msg.write_blocks is not None:
            cache = runner.kv_cache  # [L, 2, S, g, D]
            L, two, _, g, D = cache.shape
            kv = cache.new_empty(L, two, len(msg.write_blocks), runner.block_size, g, D)
            runner.write_blocks(msg.write_blocks, comm.recv_tensor(kv, 0, group))
        if msg.sched is not None:
            runner.follow(msg.sched)  # the forward pass (+ the LM head's collective under TP)
            steps += 1
