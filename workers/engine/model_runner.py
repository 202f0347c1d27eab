"""ModelRunner: SchedulerOutput -> one forward pass -> sampled tokens (RunnerOutput).

Speculative decoding: a chunk with ``num_draft`` drafts needs logits on its last num_draft + 1
rows; ``execute`` verifies them (workers/sample/rejection_sampler.py) with the request's own
generator and returns the accepted drafts plus the target's next token.

Owns the model, the KV cache tensors and per-request sampling state (params, generator, a view of
the request's token list for penalties: workers/sample/penalties.py). It turns
the scheduler's lists (token ids, start positions, block tables) into tensors once per step:
flat input ids and positions, the cache slot of every new token, and the attention metadata that
every layer shares. Logits are computed only for rows that are sampled.

Parallel gangs: under TP the KV cache holds this rank's kv heads and ``compute_logits`` is a
collective of the tp group (followers join it through ``follow``); under SP long prefill chunks
are split (``sp_split``) and this rank builds inputs for its zigzag pieces only (``_ring_chunk``,
see workers/layers/ring_attention.py), after every replicated row of the step.

Axes: T tokens in the step, B single-token chunks, L context, S cache slots, G kv heads, D head dim.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import cpu_kernels_available, set_cpu_kernels_enabled

from workers.config import EngineConfig
from workers.engine.cuda_graphs import DecodeGraphs, Graph
from workers.engine.device import resolve_for_process
from workers.errors import ConfigError
from workers.lora.adapter_set import AdapterSet
from workers.lora.attach import attach_lora
from workers.layers.attention_metadata import AttentionMetadata, PrefillSpan
from workers.layers.quant_linear import StepRows
from workers.layers.ring_attention import RingChunk, zigzag_pieces
from workers.sample.draw import skip_draws
from workers.sample.logprobs import TokenLogprob
from workers.sample.penalties import RowContext
from workers.sample.sampler import Sampler
from workers.models.config import ModelSpec
from workers.models.checkpoint import checkpoint_dir
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model
from workers.models.shared_weights import SharedWeights
from workers.models.spec_record import read_spec, record_dir
from workers.startup import StartupTimeline
from workers.parallel.groups import get_group
from workers.parallel.sharding import attention_shard
from workers.engine.runner import KVLayout, MoEStats, RunnerOutput, RunnerTiming
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.engine.proposer import Draft
from workers.sample.rejection_sampler import VerifySpan, verify_spans
from workers.sample.grammar_masks import MaskWorker, gather_masks, verify_masks
from workers.structured.matcher import GrammarError, GrammarMatcher

logger = logging.getLogger(__name__)

# Sequence parallel: a prefill chunk is split over the W sp ranks when it has at least this many
# tokens per rank; shorter chunks run replicated (a ring hop costs more than it saves).
SP_MIN_TOKENS_PER_RANK = 8


@dataclass(frozen=True)
class _RequestState:
    """A request's sampling state: params, the engine's live token list (prompt + output, read only
    here), where its generated tokens start (for penalties and the grammar), how long its prompt is
    and, for structured output, its grammar matcher (workers/structured/matcher.py)."""

    params: SamplingParams
    token_ids: list[int]
    output_start: int
    num_prompt: int
    matcher: GrammarMatcher | None = None  # structured output: the request's grammar state
    lora_slot: int = -1  # the slot of its LoRA adapter (workers/lora/), -1 = the base model

    def context(self) -> RowContext:
        return RowContext(self.params, self.token_ids, self.output_start, len(self.token_ids) - self.num_prompt)


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of one KV block over all layers; ``num_kv_heads``: this rank's heads (tensor parallel)."""
    g = spec.num_kv_heads if num_kv_heads is None else num_kv_heads
    return spec.num_layers * 2 * block_size * g * spec.head_dim * dtype.itemsize


def _decode_rows(c: ScheduledChunk) -> list[ScheduledChunk]:
    """A chunk as single-token rows (a decode is already one); every row of a verify chunk samples."""
    if len(c.token_ids) == 1:
        return [c]
    return [ScheduledChunk(c.request_id, [t], c.start_pos + i, c.block_table, sample=True)
            for i, t in enumerate(c.token_ids)]


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python 3.11 lacks the name


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, populate: bool = False,
           huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it lives in an anonymous private memory map: the kernel hands
    out zero pages on first touch, so allocating is O(1) (a start or a standby's promotion does not
    wait for it; ``torch.zeros`` writes every byte up front, ~0.5 s for 256 MiB on a busy host).
    populate: commit the memory anyway, on a background thread (MADV_POPULATE_WRITE: faults every page
    in writable without touching its contents, so it is safe beside the engine's writes), so the
    worker's memory is all resident soon after it serves -- a memory limit is hit at start, not
    under load later, and the resident size stays flat while serving.
    huge_pages: ask for transparent huge pages (MADV_HUGEPAGE; Linux with THP in 'madvise' or 'always'
    mode): decode attention reads every running sequence's blocks each step, scattered over the whole
    pool, and with 4 KiB pages most of those reads also miss the TLB. Where the kernel has no THP the
    advice is ignored and the map keeps ordinary pages. Elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):  # before the first touch, so faults take huge pages
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # THP compiled out or disabled: ordinary pages, nothing else changes
            logger.info("KV cache: transparent huge pages unavailable here (%s); it keeps 4 KiB pages", e)
    if populate:
        threading.Thread(target=_populate, args=(buf,), name="duet-kv-populate", daemon=True).start()
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def _populate(buf: mmap.mmap) -> None:
    try:
        madvise_releasing_gil(buf, _MADV_POPULATE_WRITE)
    except (OSError, ValueError) as e:  # an older kernel: pages stay lazily committed, nothing else changes
        logger.info("KV cache: MADV_POPULATE_WRITE unsupported here (%s); its pages become resident on first use", e)


def madvise_releasing_gil(buf: mmap.mmap, advice: int) -> None:
    """madvise(2) over the whole map through libc, which ctypes calls with the GIL released.
    ``mmap.madvise`` holds the GIL while the kernel works, so a populate "in the background" stalled
    every Python thread of the worker until the whole cache was committed (~0.5 s for 256 MiB on a
    busy host: most of a start's kv phase). OSError with the kernel's errno on failure."""
    view = ctypes.c_char.from_buffer(buf)  # an export of the map: it cannot be closed while we advise
    try:
        if _LIBC.madvise(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(len(buf)), ctypes.c_int(advice)):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        del view


_LIBC = ctypes.CDLL(None, use_errno=True)  # this process's libc (madvise_releasing_gil)


def cache_blocks(config: EngineConfig, spec: ModelSpec) -> int:
    """KV blocks per rank: ``cache.num_blocks``, or what ``kv_cache_memory_bytes`` holds. Under tensor
    parallelism the pool is sized by the largest per-rank share of kv heads (rank 0's), so every
    rank of a gang gets the same block count as the leader's block manager."""
    tp = get_group("tp")
    kv_heads = attention_shard(spec.num_heads, spec.num_kv_heads, tp.world_size, 0).kv_heads.size
    return config.cache.num_blocks or config.cache.kv_cache_memory_bytes // kv_bytes_per_block(
        spec, config.cache.block_size, config.kv_dtype, kv_heads)


class ModelRunner:
    """Implements workers.engine.runner.Runner in one process (or as one rank of a gang: then its KV cache
    and ``read_blocks`` / ``write_blocks`` hold only this rank's kv heads, see ``kv_layout``)."""

    def __init__(self, model: LlamaForCausalLM, spec: ModelSpec, config: EngineConfig, num_blocks: int) -> None:
        self.model = model
        self._step_rows: StepRows | None = getattr(model, "step_rows", None)  # set by the loader's bf16 copies
        self.spec = spec
        self.config = config
        # a runner built around an already loaded model (tests) may get an unresolved 'auto': the
        # model's own device is the answer then (from_config always passes a resolved config)
        if config.device == "auto":
            first = next(model.parameters(), None)
            self.device = first.device if first is not None else torch.device("cpu")
        else:
            self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        slots = num_blocks * self.block_size
        tp = get_group("tp")
        # tensor parallel: this rank's kv heads (a slice of the model's, see workers/parallel/sharding.py)
        self.kv_heads = attention_shard(spec.num_heads, spec.num_kv_heads, tp.world_size, tp.rank).kv_heads
        g = getattr(model, "num_local_kv_heads", spec.num_kv_heads)
        assert g == self.kv_heads.size, (g, self.kv_heads)
        # [layers, 2, S, G, D]; zeros, not empty: padded gathers read unused slots, which are masked
        # out, but NaN garbage would still poison the masked softmax.
        self.kv_cache = zeroed((spec.num_layers, 2, slots, g, spec.head_dim), config.kv_dtype, self.device,
                               populate=True, huge_pages=config.memory_tuning)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler(frozenset(spec.eos_token_ids))
        self._requests: dict[str, _RequestState] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._block_offsets = torch.arange(self.block_size)  # metadata is built on CPU, then moved
        self.graphs: DecodeGraphs | None = None  # CUDA graphs for decode-only steps (capture_graphs)
        self._mask_worker: MaskWorker | None = None  # structured output: masks beside the forward pass
        self._prepare_s = 0.0  # the latest forward's input preparation (seconds)
        # LoRA (config.lora.enabled): the adapter slots the model's layers apply, per step by token
        self.adapters: AdapterSet | None = attach_lora(model, config.lora, self.device) if config.lora.enabled else None

    def capture_graphs(self, max_model_len: int, sizes: tuple[int, ...] | None = None,
                       graph_factory: Callable[[], Graph] | None = None) -> None:
        """Capture decode forwards at ``sizes`` (default ``config.graph_capture_sizes``; see
        workers/engine/cuda_graphs.py); one rank only. graph_factory: CUDA graphs by default (tests pass
        ``EagerReplay`` to run the static-buffer and padding logic on CPU)."""
        if not (get_group("tp").is_trivial and get_group("sp").is_trivial and get_group("ep").is_trivial):
            raise ConfigError("cuda_graphs: supported with tensor, sequence and expert parallel size 1 only; "
                              "set cuda_graphs to false for this pool")
        self.graphs = DecodeGraphs(self.model, self.kv_caches, sizes or self.config.graph_capture_sizes, self.block_size,
                                   -(-max_model_len // self.block_size), self.device, graph_factory)

    @classmethod
    def from_config(cls, config: EngineConfig, timeline: StartupTimeline | None = None) -> ModelRunner:
        """Load ``config.model`` (this rank's shard of it inside a gang) and size the KV cache.
        timeline: marks the kernels, weights and kv phases (workers/startup.py)."""
        config = resolve_for_process(config, checkpoint_dir(config.model))  # idempotent (an engine's is resolved)
        model, spec = cls.load(config, timeline)
        runner = cls(model, spec, config, cache_blocks(config, spec))
        if timeline is not None:
            timeline.mark("kv")
        return runner

    @staticmethod
    def load(config: EngineConfig, timeline: StartupTimeline | None = None) -> tuple[LlamaForCausalLM, ModelSpec]:
        """The model of ``config`` without a KV cache (what a standby replica holds): the CPU kernels
        loaded, then the weights (mapped from the node's snapshot with ``shared_weights_dir``)."""
        path = checkpoint_dir(config.model)
        config = resolve_for_process(config, path)  # idempotent: an engine passes a resolved config
        spec = ModelRunner.load_spec_and_kernels(config, timeline)
        shared = SharedWeights(Path(config.shared_weights_dir)) if config.shared_weights_dir else None
        model, spec = load_model(path, config.torch_dtype, config.device, config.quantization,
                                 fused_decode=config.fused_decode, shared=shared, spec=spec,
                                 prepack_weights=config.prepack_weights, quantized_batches=config.quantized_batches)
        if timeline is not None:
            timeline.mark("weights", note=shared.last_source if shared is not None else "checkpoint")
        return model, spec

    @staticmethod
    def load_spec_and_kernels(config: EngineConfig, timeline: StartupTimeline | None = None) -> ModelSpec:
        """What a load does before the weights: the checkpoint's config read (in a fresh process its
        first read imports transformers' configuration code, unless the node recorded the spec) and the CPU kernels loaded (marks config,
        kernels). A warm worker process runs it ahead of time (workers/build.py ``prewarm``)."""
        # with a node directory, a later start reads the spec the node's first start recorded
        # there instead of importing transformers (workers/models/spec_record.py)
        spec = read_spec(checkpoint_dir(config.model), record_dir(config.shared_weights_dir))
        if timeline is not None:
            timeline.mark("config")
        if not config.cpu_kernels:
            set_cpu_kernels_enabled(False)  # process-wide: this process runs one model
        elif config.device == "cpu":
            cpu_kernels_available()  # load (or build) now rather than inside the first request
        if timeline is not None:
            timeline.mark("kernels")
        return spec

    def kv_layout(self) -> KVLayout:
        s = self.spec
        return KVLayout(s.num_layers, self.block_size, s.num_kv_heads, s.head_dim, self.config.kv_dtype,
                        self.kv_heads.start, self.kv_heads.size)

    def moe_stats(self) -> MoEStats:
        moe = getattr(self.model, "moe_layers", None)
        if moe is None:
            return MoEStats()
        layers = moe()
        return MoEStats(tuple(sum(layer.expert_counts for layer in layers).tolist()),
                        tuple(sum(layer.rank_rows for layer in layers).tolist()))

    # ---------------------------------------------------------- request state
    def add_request(self, request_id: str, params: SamplingParams, token_ids: list[int],
                    num_prompt: int, output_start: int | None = None, matcher: GrammarMatcher | None = None,
                    lora_slot: int = -1) -> None:
        """token_ids: the request's live token list (the engine appends generated tokens to it; the
        runner only reads it); its first num_prompt are the prompt. output_start: where the tokens
        counted as generated for presence/frequency penalties start (default num_prompt; earlier
        when a resumed request's prompt ends with tokens generated before). matcher: structured
        output (ready before the request is scheduled): its masks constrain every sampled token.
        lora_slot: the adapter slot its tokens run with (``adapters.acquire``; -1 = the base model)."""
        start = num_prompt if output_start is None else output_start
        assert lora_slot < 0 or self.adapters is not None, "a LoRA slot on a runner without LoRA"
        self._requests[request_id] = _RequestState(params, token_ids, start, num_prompt, matcher, lora_slot)
        if params.seed is not None:
            gen = self._generators[request_id] = torch.Generator(device="cpu").manual_seed(params.seed)
            if num_prompt > start:  # resumed: its earlier run drew one uniform per token it sampled
                skip_draws(gen, num_prompt - start)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._generators.pop(request_id, None)

    def generator_state(self, request_id: str) -> bytes | None:
        """The request's own sampling generator state (None without a seed), for hand-over."""
        gen = self._generators.get(request_id)
        return None if gen is None else bytes(gen.get_state().tolist())

    def set_generator_state(self, request_id: str, state: bytes) -> None:
        gen = self._generators.get(request_id)
        assert gen is not None, f"{request_id} has no seeded generator"
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    # ------------------------------------------------------------- KV blocks
    def _blocks_view(self) -> torch.Tensor:
        L, _, S, G, D = self.kv_cache.shape
        return self.kv_cache.view(L, 2, S // self.block_size, self.block_size, G, D)  # [L, 2, NB, bs, G, D]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks' K/V: [L, 2, n, bs, G, D] (this rank's kv heads)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self._blocks_view().index_select(2, ids)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrite the given blocks with kv [L, 2, n, bs, G, D] (from ``read_blocks`` elsewhere).
        On the CPU block by block (a strided copy each: index_copy_ along the block axis is several
        times slower there); on a GPU one index_copy_ after one host-to-device copy."""
        view = self._blocks_view()  # [L, 2, NB, bs, G, D]
        if self.device.type == "cpu":
            for j, block_id in enumerate(block_ids):
                view[:, :, block_id].copy_(kv[:, :, j])  # (casts to the cache dtype if it differs)
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        view.index_copy_(2, ids, kv.to(device=self.device, dtype=self.kv_cache.dtype))

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, drafts: Mapping[str, Draft] | None = None) -> RunnerOutput:
        """Run the step and sample. drafts: the proposer's drafts by request id (their distributions
        q, for sampled requests; the draft ids themselves are the chunks' last num_draft tokens)."""
        t0 = time.perf_counter()
        masks = self._start_masks(sched)  # structured output: computed while the forward pass runs
        hidden, sample_rows = self.forward(sched)  # [T, E]
        t_forward = time.perf_counter()
        forward_s = t_forward - t0 - self._prepare_s
        if not sample_rows:
            return RunnerOutput({}, timing=RunnerTiming(self._prepare_s, forward_s))
        logits = self.model.compute_logits(hidden[[r for r, _ in sample_rows]])  # [N, V]
        assert logits is not None  # the leader (tp rank 0) holds them
        t_logits = time.perf_counter()
        results = masks.result() if masks is not None else {}
        verify = {c.request_id: c for c in sched.chunks if c.num_draft}
        plain: list[int] = []  # logits rows sampled one token each
        spans: list[tuple[int, ScheduledChunk]] = []  # (first logits row, chunk) of verified chunks
        i = 0
        while i < len(sample_rows):
            chunk = verify.get(sample_rows[i][1])
            if chunk is None:
                plain.append(i)
                i += 1
            else:
                spans.append((i, chunk))
                i += chunk.num_draft + 1
        out: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        errors: dict[str, GrammarError] = {}  # structured output at a dead end: not sampled
        if plain:
            ids = [sample_rows[i][1] for i in plain]
            rows = [self._requests[r].context() for r in ids]
            allowed, bad = gather_masks(ids, results, logits.shape[1])  # [N, V] bool or None
            if bad:
                errors.update((ids[j], e) for j, e in bad.items())
                keep = [j for j in range(len(ids)) if j not in bad]
                plain, ids, rows = [plain[j] for j in keep], [ids[j] for j in keep], [rows[j] for j in keep]
                assert allowed is not None  # a row had a mask (it failed)
                allowed = allowed[keep]
        if plain:
            # every row (the usual step): the logits themselves, not a gathered copy of them
            own = logits if len(plain) == logits.shape[0] else logits[plain]
            tokens, lps = self.sampler(own, rows, [self._generator(r) for r in ids], allowed)
            out.update((r, [t]) for r, t in zip(ids, tokens))
            logprobs.update((r, [lp]) for r, lp in zip(ids, lps) if lp is not None)
        vspans = self._verify_spans(spans, drafts or {}, logits.shape[1], errors)
        if vspans:
            for s, (span_tokens, span_lps) in zip(vspans, verify_spans(self.sampler, logits, vspans)):
                out[s.request_id] = span_tokens
                if span_lps is not None:
                    logprobs[s.request_id] = span_lps
        timing = RunnerTiming(self._prepare_s, forward_s, t_logits - t_forward, time.perf_counter() - t_logits)
        return RunnerOutput(out, logprobs, errors, timing)

    def _start_masks(self, sched: SchedulerOutput):
        """The MaskWorker job of this step's plain sampled rows of structured requests (or None)."""
        jobs = {}
        for c in sched.chunks:
            state = self._requests.get(c.request_id)
            if c.sample and not c.num_draft and state is not None and state.matcher is not None:
                jobs[c.request_id] = (state.context(), state.matcher)
        if not jobs:
            return None
        if self._mask_worker is None:
            self._mask_worker = MaskWorker(self.spec.vocab_size, self.sampler.eos_token_ids,
                                           threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._mask_worker.start(jobs)

    def _verify_spans(self, spans: list[tuple[int, ScheduledChunk]], drafts: Mapping[str, Draft], vocab_size: int,
                      errors: dict[str, GrammarError]) -> list[VerifySpan]:
        """The verify chunks as VerifySpans (with their grammar masks); a structured request whose
        grammar is at a dead end goes to ``errors`` instead."""
        vspans = []
        for i, c in spans:
            k, rid, d = c.num_draft, c.request_id, drafts.get(c.request_id)
            state = self._requests[rid]
            context, draft, allowed = state.context(), c.token_ids[-k:], None
            if state.matcher is not None:
                try:
                    allowed, k = verify_masks(context, state.matcher, draft, vocab_size, self.sampler.eos_token_ids)
                except GrammarError as e:
                    errors[rid] = e
                    continue
                draft = draft[:k]
            q = None if d is None or d.probs is None else d.probs[:k]  # [k, V]
            vspans.append(VerifySpan(i, context, draft, q, self._generator(rid), allowed, rid))
        return vspans

    def _generator(self, request_id: str) -> torch.Generator:
        return self._generators.get(request_id, self._default_generator)

    @torch.inference_mode()
    def follow(self, sched: SchedulerOutput) -> None:
        """A follower rank's share of ``execute``: the forward pass, and the LM head's collective when
        the vocabulary is sharded (tensor parallel); the leader alone samples."""
        hidden, sample_rows = self.forward(sched)
        if sample_rows and self.logits_collective and get_group("sp").rank == 0:
            self.model.compute_logits(hidden[[r for r, _ in sample_rows]])

    @property
    def logits_collective(self) -> bool:
        """compute_logits is a collective of this rank's tp group, which then owns rank 0's logits."""
        return not get_group("tp").is_trivial

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[tuple[int, str]]]:
        """Run the model over the step's tokens and write their KV: hidden [T, E] and the
        (row, request id) pairs to sample. Ranks of a gang that do not sample call only this."""
        # Single-token chunks (decodes) go first: they share one batched attention call. A verify
        # chunk (last token + drafts) runs as one decode row per token, each attending to the
        # context up to itself: the same kernel, per-row arithmetic and rounding as plain decoding,
        # so greedy verification reproduces plain greedy output exactly wherever the linear layers
        # are row-invariant (the quantized kernels are; see tests/workers/spec_decode/test_spec_decode_engine.py).
        t0 = time.perf_counter()
        singles = [r for c in sched.chunks if len(c.token_ids) == 1 or c.num_draft for r in _decode_rows(c)]
        multis = [c for c in sched.chunks if len(c.token_ids) > 1 and not c.num_draft]
        if self.graphs is not None and not multis and self.graphs.fits(len(singles)):
            input_ids, positions, meta, sample_rows = self._prepare(singles, len(singles))
            self._prepare_s = time.perf_counter() - t0
            return self.graphs.run(input_ids, positions, meta), sample_rows
        rest, split = self.sp_split(multis)
        input_ids, positions, meta, sample_rows = self._prepare(singles + rest, len(singles), split)
        if self._step_rows is not None:  # quantized layers keep the decode rows on their kernel
            self._step_rows.decode = len(singles)
        if self.adapters is None:
            self._prepare_s = time.perf_counter() - t0  # (RunnerTiming.prepare_s of this step)
            return self.model(input_ids, positions, self.kv_caches, meta), sample_rows
        stacks = self.adapters.stacks  # LoRA: each token's adapter slot, in row order (sp is refused with lora)
        stacks.begin_step([self._lora_slot(c.request_id) for c in singles + rest for _ in c.token_ids])
        self._prepare_s = time.perf_counter() - t0
        try:
            return self.model(input_ids, positions, self.kv_caches, meta), sample_rows
        finally:
            stacks.end_step()

    def _lora_slot(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return -1 if state is None else state.lora_slot

    @staticmethod
    def sp_split(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """(replicated, split over the sp ranks): prefill chunks long enough for sequence parallelism."""
        w = get_group("sp").world_size
        long = [w > 1 and len(c.token_ids) >= SP_MIN_TOKENS_PER_RANK * w for c in chunks]
        return [c for c, x in zip(chunks, long) if not x], [c for c, x in zip(chunks, long) if x]

    def _context_slots(self, table: list[int], end: int) -> torch.Tensor:
        """Cache slots of token positions [0, end) of a sequence with this block table: [end]."""
        bt = torch.tensor(table[: -(-end // self.block_size)], dtype=torch.long)
        return (bt[:, None] * self.block_size + self._block_offsets).view(-1)[:end]

    def _prefill_span(self, c: ScheduledChunk, row: int) -> PrefillSpan:
        """The plain (SDPA) path's view of a prefill chunk at rows [row, row + n) of the step."""
        n = len(c.token_ids)
        if c.start_pos == 0:
            return PrefillSpan(row, row + n, None, None)
        end = c.start_pos + n
        mask = torch.arange(end)[None, :] <= torch.arange(c.start_pos, end)[:, None]  # [n, L]
        ctx = self._context_slots(c.block_table, end)
        return PrefillSpan(row, row + n, ctx.to(self.device), mask.to(self.device))

    def _tables(self, tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block tables padded with 0 to [N, max_blocks] int32 and context lengths [N] int32 (None if N = 0)."""
        if not tables:
            return None, None
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return (
            torch.tensor(padded, dtype=torch.int32, device=self.device),
            torch.tensor(lens, dtype=torch.int32, device=self.device),
        )

    def _ring_chunk(self, c: ScheduledChunk, row: int) -> tuple[RingChunk, list[int], list[int], list[int]]:
        """This rank's zigzag pieces of a sequence-parallel chunk: (metadata, ids, positions, slots)."""
        sp = get_group("sp")
        w, r, bs = sp.world_size, sp.rank, self.block_size
        sizes = zigzag_pieces(len(c.token_ids), w)
        offsets = [sum(sizes[:i]) for i in range(2 * w)]
        table = c.block_table
        piece_slots = [[table[p // bs] * bs + p % bs for p in range(c.start_pos + o, c.start_pos + o + n)]
                       for o, n in zip(offsets, sizes)]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for i in (r, 2 * w - 1 - r):
            ids += c.token_ids[offsets[i] : offsets[i] + sizes[i]]
            pos += range(c.start_pos + offsets[i], c.start_pos + offsets[i] + sizes[i])
            slots += piece_slots[i]
        prefix = self._context_slots(table, c.start_pos).to(self.device) if c.start_pos else None
        rc = RingChunk(row, (r, 2 * w - 1 - r), tuple(sizes),
                       tuple(torch.tensor(s, dtype=torch.long, device=self.device) for s in piece_slots), prefix)
        return rc, ids, pos, slots

    def _prepare(self, chunks: list[ScheduledChunk], num_singles: int, split: Sequence[ScheduledChunk] = ()):
        """Flat inputs and attention metadata: ``chunks`` (the first ``num_singles`` of them decodes),
        then this rank's pieces of the sequence-parallel ``split`` chunks (sampled on sp rank 0,
        which holds every chunk's last piece)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, str]] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        prefill_lens: list[int] = []
        prefill_cu: list[int] = [0]
        row = 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            end = c.start_pos + n
            table = c.block_table
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start_pos, end))
            if i < num_singles:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefill_tables.append(table)
                prefill_lens.append(end)
                prefill_cu.append(prefill_cu[-1] + n)
                prefills.append(self._prefill_span(c, row))
            row += n
            if c.sample:
                sample_rows.append((row - 1, c.request_id))
        ring = []
        for c in split:
            rc, c_ids, c_pos, c_slots = self._ring_chunk(c, row)
            ids += c_ids
            pos += c_pos
            slots += c_slots
            ring.append(rc)
            row += rc.num_rows
            if c.sample and rc.local[0] == 0:
                sample_rows.append((row - 1, c.request_id))
        block_tables, context_lens = self._tables(decode_tables, decode_lens)  # [B, max_blocks], [B]
        prefill_block_tables, prefill_context_lens = self._tables(prefill_tables, prefill_lens)  # [P, .], [P]
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_singles,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            prefills=prefills,
            prefill_block_tables=prefill_block_tables,
            prefill_cu_seqlens=torch.tensor(prefill_cu, dtype=torch.int32, device=self.device) if prefills else None,
            prefill_context_lens=prefill_context_lens,
            ring=tuple(ring),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, meta, sample_rows
