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

Worked example (every rank)::

    init_parallel_groups(ParallelConfig(ep_size=W), rank, init_method)
    engine = Engine(config)                       # every rank loads its experts
    if rank == 0:
        leader = GangLeader(engine, get_group("gang"))
        ... drive engine.step() as usual ...
        leader.stop()
    else:
        follow(engine.runner, get_group("gang"))   # returns when the leader stops

Failure: a dead rank makes the next collective raise on every other rank (gloo sees the closed
connection; a stuck peer hits the process group's timeout), so a gang fails fast rather than hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from workers.model_runner import ModelRunner, RunnerOutput
from workers.spec_decode.proposer import Draft
from workers.parallel import comm
from workers.parallel.eplb import Rebalancer
from workers.parallel.expert_placement import ExpertPlacement
from workers.parallel.groups import GroupCoordinator
from workers.sampling_params import SamplingParams
from workers.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GangMessage:
    """One control message from the leader: a step to run, new placements to apply, or stop.
    Followers wait for it on the "gang" group, whose timeout is long (the leader may idle for
    hours between requests); a dead leader still fails the wait at once."""

    sched: SchedulerOutput | None = None
    placements: list[ExpertPlacement] | None = None
    stop: bool = False


def apply_placements(model, placements: list[ExpertPlacement]) -> None:
    """Switch every MoE layer to its new placement (collective: weights move from home ranks)."""
    for layer, placement in zip(model.moe_layers(), placements):
        layer.set_placement(placement)


class GangRunner:
    """The leader's runner: broadcasts each step, then runs it like a ModelRunner (same interface)."""

    def __init__(self, runner: ModelRunner, group: GroupCoordinator, rebalancer: Rebalancer | None = None) -> None:
        self.inner = runner
        self.group = group
        self.rebalancer = rebalancer

    @property
    def model(self):
        return self.inner.model

    def add_request(self, request_id: str, params: SamplingParams, token_ids: list[int], num_prompt: int,
                    output_start: int | None = None) -> None:
        self.inner.add_request(request_id, params, token_ids, num_prompt, output_start)

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)

    def execute(self, sched: SchedulerOutput, drafts: Mapping[str, Draft] | None = None) -> RunnerOutput:
        """drafts only matter to sampling, which the leader alone does: they are not broadcast."""
        if self.rebalancer is not None:
            plans = self.rebalancer.maybe_plan()
            if plans is not None:
                self.rebalance(plans)
        comm.broadcast_object(GangMessage(sched=sched), 0, self.group)
        return self.inner.execute(sched, drafts)

    def rebalance(self, placements: list[ExpertPlacement]) -> None:
        comm.broadcast_object(GangMessage(placements=placements), 0, self.group)
        apply_placements(self.inner.model, placements)
        logger.info("applied new expert placements (%d replicas in all)",
                    sum(len(r) - 1 for p in placements for r in p.replicas))

    def stop(self) -> None:
        comm.broadcast_object(GangMessage(stop=True), 0, self.group)


class GangLeader:
    """Turns rank 0's engine into the gang's leader by swapping in a GangRunner."""

    def __init__(self, engine, group: GroupCoordinator, rebalancer: Rebalancer | None = None) -> None:
        self.engine = engine
        self.runner = GangRunner(engine.runner, group, rebalancer)
        engine.runner = self.runner

    def rebalance(self, placements: list[ExpertPlacement]) -> None:
        self.runner.rebalance(placements)

    def stop(self) -> None:
        self.runner.stop()


def follow(runner: ModelRunner, group: GroupCoordinator) -> int:
    """A follower's loop: run each step the leader broadcasts until it says stop. Returns the number
    of steps run. Raises (RuntimeError from the collective) if a peer dies."""
    steps = 0
    while True:
        msg: GangMessage = comm.broadcast_object(None, 0, group)
        if msg.stop:
            return steps
        if msg.placements is not None:
            apply_placements(runner.model, msg.placements)
        if msg.sched is not None:
            runner.follow(msg.sched)  # the forward pass (+ the LM head's collective under TP)
            steps += 1
