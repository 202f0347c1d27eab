"""The request path through the router, in one method (``Pipeline.generate``):

    prepare (tokenize, validate)  ->  admission slot  ->  route (policy picks a worker, or a
    (prefill, decode) pair: router/policies/disagg.py)  ->  attempt (Submit stream, incremental
    detokenization + stop strings: router/worker_stream.py)  ->  GenerateResponse stream

Each attempt ends with an ``AttemptOutcome`` value (router/attempt.py), and one loop
(``_route_and_stream``) decides from it, through ``AttemptBudget.decide``, whether the request is
done, is retried or resumed on another worker, or fails with a status for the client. The loop
holds no gRPC server context: ``generate`` takes a public GenerateRequest and a monotonic
deadline, yields GenerateResponses and raises RequestError, for any front door (gRPC, HTTP).

Several models and LoRA adapters (router/catalog.py): ``prepare`` resolves the request's ``model``
to its served model (its tokenizer, chat template and context limit) and adapter; the route is
chosen among that model's workers only (``serves``: the member's model), an adapter request
prefers the workers holding its adapter (router/policies/adapter_affinity.py) and carries it to
the worker (SubmitRequest.adapter), on every attempt, retry and resume.

Speculative requests on a worker whose pool drafts on a drafter pool also get a drafter replica
(router/drafters.py ``DrafterRouting``, router/policies/drafter.py) with each attempt; the worker
is handed its endpoint and streams the request's draft rounds there itself.

Disaggregated routes: the Submit goes to the decode worker with ``remote_prefill`` naming the
prefill worker; the decode worker has it prefill and send the KV directly (the router never sees
KV). ABORTED before the first token means the prefill half failed (prefill worker down or
restarted, transfer lost or rejected): the prefill worker is reported failed and the request is
retried colocated on a decode worker (once, with the default ``max_route_attempts`` of 2;
router/policies/disagg.py); with none left it ends with UNAVAILABLE.

Terms:
    first token  a failure before any token reached the client is retried on another worker
                 (up to ``max_route_attempts`` workers, for UNAVAILABLE and a full worker queue).
    resume       a worker that dies after tokens reached the client: the request continues on
                 another healthy worker from prompt + the tokens streamed so far, with the rest of
                 its max_tokens (up to ``max_resumes`` times). The client sees one uninterrupted
                 stream. Under greedy decoding the output is identical to an uninterrupted run; a
                 sampled request continues with a fresh sampler state (valid samples, not the same
                 ones). With ``resume_on_worker_failure`` off, or once resumes run out, the stream
                 ends with UNAVAILABLE, retryable by the client.
    waiting      with no healthy worker (all restarting, say, or its pool scaled to zero), a request
                 is held (router/hold.py: in arrival order, holding its admission slot) up to
                 ``worker_wait_s`` -- ``wake_timeout_s`` while the controller wakes its pool --
                 and its deadline, for one that it has not failed on, instead of failing at once.

Error mapping (worker status -> client status): router/attempt.py. In short: bad input passes
through, DEADLINE_EXCEEDED stays, a dead worker (UNAVAILABLE, CANCELLED by the worker, a stream
without a finish reason) or a full queue (RESOURCE_EXHAUSTED) is retried elsewhere, anything else
passes through prefixed with the worker id.

Cancellation: when the client cancels or its deadline passes, the front door cancels the
handler task (or closes this stream); the attempt's ``finally`` cancels the worker call, and the
worker aborts the request and frees its KV blocks. When the router's detokenizer finds a stop
string first, it ends the client's stream with STOP and cancels the worker call the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

import grpc

from protos.duet.v1 import duet_pb2
from router.admission import AdmissionController, AdmissionRejected
from router.attempt import Action, AttemptBudget, AttemptOutcome, Decision, OutcomeKind, worker_process
from router.config import RouterConfig
from router.drafters import DrafterRouting
from router.hold import HeldTooLong, WorkerHold
from router.catalog import ModelCatalog
from router.policies import NoWorkersAvailable, RouteRequest, RoutingPolicy, WorkerState
from router.policies.adapter_affinity import AdapterAffinityPolicy
from router.policies.disagg import DisaggRouter, Route
from router.policies.drafter import make_drafter_policy
from router.policies.prefix_pull import PrefixPullPlanner
from router.prefix_index import PrefixIndex
from router.preprocess import PreparedRequest, RequestError, ServedModel, prepare_request
from router.request_metrics import RequestClock, RequestMetrics
from router.worker_stream import Progress, stream_attempt
from router.workers import WorkerDirectory, WorkerLease
from workers.detokenizer import IncrementalDetokenizer  # the one sanctioned workers import (pure Python)

logger = logging.getLogger(__name__)


_OFFLOAD_CHARS = 16_384  # prompts longer than this are tokenized on a thread, off the event loop


class Pipeline:
    def __init__(self, config: RouterConfig, model: ServedModel, directory: WorkerDirectory,
                 policy: RoutingPolicy, admission: AdmissionController, metrics: RequestMetrics | None = None,
                 hold: WorkerHold | None = None, catalog: ModelCatalog | None = None,
                 holdings: PrefixIndex | None = None) -> None:
        """holdings: the workers' reported prefix holdings (router/prefix_index.py), for the prefix
        pull planner; None: it goes by what this router sent where."""
        self.config = config
        self.model = model  # the default model
        # every served model and adapter (router/catalog.py); one model alone by default
        self.catalog = catalog or ModelCatalog.single(model)
        assert self.catalog.default is model, "the catalog's default model must be the pipeline's model"
        self.directory = directory
        self.policy = policy
        # LoRA requests prefer workers holding their adapter (router/policies/adapter_affinity.py)
        self.router = DisaggRouter(AdapterAffinityPolicy(policy), block_size=config.disagg_block_size,
                                   min_prompt_tokens=config.disagg_min_prompt_tokens)
        self.pull_planner = (PrefixPullPlanner(config.prefix_pull_min_tokens, config.disagg_block_size, holdings)
                             if config.prefix_pull_min_tokens else None)
        self.admission = admission
        self.drafters = DrafterRouting(
            directory.drafters, make_drafter_policy(config.drafter_policy, **config.drafter_policy_options))
        self.counts: Counter[str] = Counter()
        self.metrics = metrics or RequestMetrics()  # per-pool latency histograms (router/request_metrics.py)
        # requests no worker can take yet, in arrival order (router/hold.py; the server passes one that wakes pools)
        self.hold = hold or WorkerHold(worker_wait_s=config.worker_wait_s, wake_timeout_s=config.wake_timeout_s)

    async def generate(self, request: duet_pb2.GenerateRequest, *,
                       deadline: float | None = None) -> AsyncGenerator[duet_pb2.GenerateResponse, None]:
        """Stream the completion of ``request``; ``deadline`` is a time.monotonic() instant.
        Raises RequestError (status code + message) for anything the client should see."""
        self.counts["requests"] += 1
        received = time.monotonic()
        try:
            prep = await self._prepare(request)
            async with self.admission.slot(), aclosing(self._route_and_stream(prep, deadline, received)) as stream:
                async for response in stream:
                    yield response
        except AdmissionRejected as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except RequestError as e:
            self.counts[f"error_{e.code.name.lower()}"] += 1
            raise

    async def _prepare(self, request: duet_pb2.GenerateRequest) -> PreparedRequest:
        model, adapter = self.catalog.resolve(request.model)  # NOT_FOUND for an unknown model or adapter
        spec = adapter.spec if adapter is not None else None
        size = len(request.prompt) + sum(len(m.content) for m in request.messages.messages)
        if size > _OFFLOAD_CHARS or request.sampling.HasField("structured"):  # a grammar compile may take ms
            return await asyncio.to_thread(prepare_request, request, model, self.config, adapter=spec)
        return prepare_request(request, model, self.config, adapter=spec)

    async def _route_and_stream(self, prep: PreparedRequest, deadline: float | None,
                                received: float) -> AsyncGenerator[duet_pb2.GenerateResponse, None]:
        """The attempt loop: route, stream one attempt, decide from its outcome; repeat."""
        tokenizer = self.catalog.model(prep.model).tokenizer
        progress = Progress(IncrementalDetokenizer(tokenizer, prep.prompt_token_ids, stop=prep.stop),
                            RequestClock(received))
        if prep.resume_token_ids:
            self.counts["client_resumes"] += 1
            progress.resume_from(prep.resume_token_ids, prep.resume_text_chars)
            logger.info("request %s: resumed by its client after %d tokens (%d characters received)",
                        prep.request_id, len(prep.resume_token_ids), prep.resume_text_chars)
        budget = AttemptBudget.from_config(self.config)
        while True:
            streamed = len(progress.token_ids)
            route = RouteRequest(prep.internal_id, prep.prompt_token_ids + progress.token_ids,
                                 prep.sampling.max_tokens - streamed, prep.adapter_name)
            migration = budget.take_migration()
            try:
                chosen = self._migration_route(migration) or \
                    await self._select(route, budget, deadline, prep.model)
            except HeldTooLong as e:
                decision = budget.no_worker(str(e), streamed, wait=e.wait)
            except NoWorkersAvailable as e:
                decision = budget.no_worker(str(e), streamed)
            else:
                budget.start()
                outcome: AttemptOutcome | None = None
                attach = migration.migration_id if migration is not None and chosen.decode_id == migration.target_id \
                    else ""
                async with aclosing(self._attempt(prep, chosen, route, deadline, progress, attach)) as events:
                    async for event in events:
                        if isinstance(event, AttemptOutcome):
                            outcome = event
                        else:
                            yield event
                assert outcome is not None, "an attempt ended without an outcome"
                decision = budget.decide(outcome, len(progress.token_ids))
                if decision.action is Action.DONE:
                    assert outcome.response is not None
                    yield outcome.response
                    return
            self._record(prep, decision, budget, len(progress.token_ids))
            if decision.action is Action.FAIL:
                raise RequestError(decision.code, decision.message)

    def _migration_route(self, migration: AttemptOutcome | None) -> Route | None:
        """After a MIGRATED outcome: the target, if the directory knows it and it is healthy (else the
        usual choice, and the request resumes there by recompute)."""
        if migration is None:
            return None
        if migration.target_id not in {w.worker_id for w in self.directory.snapshot() if w.healthy}:
            logger.warning("migration target %s is not a healthy member; resuming by recompute", migration.target_id)
            return None
        return Route(decode_id=migration.target_id)

    async def _attempt(self, prep: PreparedRequest, chosen: Route, route: RouteRequest, deadline: float | None,
                       progress: Progress, migration_id: str = "") -> AsyncGenerator[duet_pb2.GenerateResponse | AttemptOutcome, None]:
        """One attempt on ``chosen`` between its leases; reports a worker its outcome blames."""
        lease = self.directory.begin(chosen.decode_id, route)
        prefill = self.directory.begin(chosen.prefill_id, route) if chosen.prefill_id else None
        drafter = self.drafters.begin(route, lease.state, prep.speculative)
        try:
            async with aclosing(stream_attempt(prep, lease, prefill, progress, deadline, self.metrics,
                                               chosen.pull, migration_id, drafter.ref if drafter is not None else None)) as events:
                async for event in events:
                    if isinstance(event, AttemptOutcome):
                        blamed = lease if not event.prefill_failed else prefill
                        if event.kind is OutcomeKind.RETRY and blamed is not None and blamed.worker_id == event.worker_id:
                            event = replace(event, process=worker_process(blamed.state))
                        self._observe(event, blamed)
                    yield event
        except (asyncio.CancelledError, GeneratorExit):
            logger.info("request %s (internal %s) cancelled by the client after %d tokens; aborting it on %s",
                        prep.request_id, prep.internal_id, len(progress.token_ids), lease.worker_id)
            self.counts["cancelled"] += 1
            raise
        finally:
            self.directory.end(lease)
            if prefill is not None:
                self.directory.end(prefill)
            self.drafters.end(drafter)
            self.router.on_request_complete(chosen.decode_id, prep.internal_id)

    def _observe(self, outcome: AttemptOutcome, blamed: WorkerLease | None) -> None:
        """Count an outcome and report the worker it blames to the directory."""
        if outcome.kind is OutcomeKind.FINISHED:
            self.counts[f"finish_{outcome.finish_reason}"] += 1
        if outcome.prefill_failed:
            self.counts["prefill_failures"] += 1
        if outcome.report:
            assert blamed is not None
            self.directory.report_stream_failure(blamed, outcome.reason)

    def _record(self, prep: PreparedRequest, decision: Decision, budget: AttemptBudget, streamed: int) -> None:
        """Count and log a decision other than DONE."""
        last = budget.last.message if budget.last is not None else ""
        if decision.action is Action.RETRY:
            self.counts["retried"] += 1
            logger.warning("request %s: %s; trying another worker", prep.request_id, last)
        elif decision.action is Action.MIGRATE:
            self.counts["migrated"] += 1
            logger.info("request %s: continuing on %s after %d streamed tokens (live migration)", prep.request_id,
                        budget.migration.target_id if budget.migration else "?", streamed)
        elif decision.action is Action.RESUME:
            self.counts["resumed"] += 1
            logger.warning("request %s: %s; resuming after %d streamed tokens on another worker (%d/%d)",
                           prep.request_id, last, streamed, budget.resumes, self.config.max_resumes)
        elif decision.mid_stream:
            self.counts["failed_mid_stream"] += 1
            logger.warning("request %s (internal %s): %s", prep.request_id, prep.internal_id, decision.message)

    def _check_adapter_support(self, route: RouteRequest, model: str) -> None:
        """An adapter request for a model whose healthy workers all report no adapter support
        (LoadReport.max_loaded_adapters 0) is refused, not run on the base model."""
        mine = [w for w in self.directory.snapshot() if w.healthy and self.serves(w, model)]
        if mine and not any(w.max_loaded_adapters for w in mine):
            self.counts["adapter_unsupported"] += 1
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"model: adapter {route.adapter!r}: no worker of {model or self.catalog.default.name} "
                               "serves LoRA adapters (their load reports say max_loaded_adapters 0)")

    def serves(self, worker: WorkerState, model: str) -> bool:
        """Whether ``worker`` serves served model ``model`` (a member without a model serves the default)."""
        return (worker.model or self.catalog.default.name) == (model or self.catalog.default.name)

    async def _select(self, route: RouteRequest, budget: AttemptBudget, deadline: float | None,
                      model: str = "") -> Route:
        """The route among the healthy workers of ``model`` the budget does not exclude (the
        processes that failed this request before its first token; a prefill worker required after
        a prefill failure); with none, the request is held (router/hold.py: in arrival order, while
        a worker may come back, restart or join, or its pool wakes from zero). Workers of other
        models are shown to the policies as unhealthy (as excluded ones are), so their per-worker
        state (prefix trees) survives requests for other models."""
        ticket, reason = None, "no healthy worker"
        require_prefill = budget.require_prefill
        if route.adapter:
            self._check_adapter_support(route, model)
        try:
            while True:
                workers = self.directory.snapshot()
                if budget.tried_process or len(self.catalog.names) > 1:
                    workers = [replace(w, healthy=False) if budget.excludes(w) or not self.serves(w, model) else w
                               for w in workers]
                if ticket is None and self.hold.held:  # others are held: no overtaking
                    ticket = self.hold.enter(("prefill",) if require_prefill else ("colocated", "decode"), deadline)
                if ticket is None or self.hold.is_head(ticket):
                    try:
                        chosen = self.router.select(route, workers, require_prefill=require_prefill)
                        if self.pull_planner is not None and chosen.prefill_id is None:
                            chosen = replace(chosen, pull=self.pull_planner.plan(route, chosen.decode_id, workers))
                        if ticket is not None:
                            self.counts["waited_for_worker"] += 1
                            self.hold.leave(ticket, served=True)
                            ticket = None
                        return chosen
                    except NoWorkersAvailable as e:
                        mine = [w for w in workers if self.serves(w, model)]
                        needed = [w for w in mine if w.role == "prefill"] if require_prefill else mine
                        # (no members at all: restarting workers rejoin, or a pool wakes: wait for them)
                        hopeless = (not needed) if require_prefill else bool(needed)
                        if hopeless and all(budget.excludes(w) for w in needed):
                            raise
                        if ticket is not None and self.hold.expired(ticket):
                            raise HeldTooLong(str(e), self.hold.why(ticket)) from None
                        reason = str(e)
                if ticket is None:
                    ticket = self.hold.enter(("prefill",) if require_prefill else ("colocated", "decode"), deadline)
                elif self.hold.expired(ticket):
                    raise HeldTooLong(reason if self.hold.is_head(ticket) else "requests held before it took the "
                                      "workers", self.hold.why(ticket))
                await self.hold.wait(ticket)
        finally:
            if ticket is not None:
                self.hold.leave(ticket, served=False)

    def stats(self) -> dict[str, object]:
        return {"requests": dict(self.counts), "admission": self.admission.stats(),
                "policy_name": self.policy.name, "workers": self.directory.describe(),
                "policy": {**self.router.counters(), **self.drafters.counters(),
                           **(self.pull_planner.counters() if self.pull_planner is not None else {})},
                "drafters": self.directory.drafters.describe(),
                "worker_stream_failures": self.directory.num_stream_failures, "hold": self.hold.stats()}

