"""Engine configuration: frozen dataclasses validated once, at the edge.

Every field error names the field, the value and the limit, so a user can fix a YAML file or a flag
without reading code. Messages start with ``<key>=<value>: `` where ``key`` is the field's path from
the ``EngineConfig`` (``cache.block_size``, ``speculative.method``, ``quantization``); the cluster
config (cluster/config/duet.py) builds its sections from these types and renames that leading key to the
YAML key (``pools[0].engine.block_size``), so each check is written once, here.

This module does not import torch (the cluster config imports it for ``duet serve --dry-run``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING, ClassVar, Literal

from workers.errors import ConfigError

if TYPE_CHECKING:
    import torch

QUANTIZATIONS = ("none", "int8", "q4")  # workers/layers/quant_linear.py
SPEC_METHODS = ("none", "ngram", "draft_model")  # workers/spec_decode/
DRAFTER_DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
PARALLEL_AXES = ("ep", "sp", "tp")  # mesh order, outermost first (workers/parallel/groups.py)
COMM_MODES = ("auto", "shm", "gloo")  # ParallelConfig.comm
KV_BACKENDS = ("auto", "shm", "gloo", "nccl")  # EngineConfig.kv_transfer_backend (workers/kv/transfer.py)
CACHE_DTYPES = ("auto", "float32", "bfloat16")  # CacheConfig.kv_cache_dtype
TIER_POLICIES = ("lru", "arc")  # CacheConfig.tier_policy (workers/kv/tiers/policy.py)
QUANTIZED_BATCHES = ("auto", "kernel", "bf16")  # EngineConfig.quantized_batches (workers/layers/quant_linear.py)
OMP_WAIT_POLICIES = ("passive", "active", "runtime")  # EngineConfig.omp_wait_policy (workers/server/threads.py)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    block_size: tokens per KV block.
    kv_cache_memory_bytes: budget for the preallocated block pool (all layers, K and V).
    num_blocks: overrides the budget with an exact block count (tests use tiny pools).
    enable_prefix_caching: reuse full blocks whose content (and whole prefix) match.
    host_tier_bytes: host-memory KV tier below the device cache: prefix-cached blocks evicted from
        the device are kept here and loaded back on a prefix hit; a preempted request resumes from
        them (swap instead of recompute). Pinned for a GPU runner. A size, 0 = off, or 'auto' (the
        default): twice the device cache's size, at most a quarter of the memory still free when the
        worker starts (under a pod's limit, of what is left below it), off without prefix caching
        (workers/kv/tiers/budget.py). Memory is taken as blocks are evicted, never reserved.
    disk_tier_bytes: local-disk KV tier below the host tier (0 = off; needs the host tier): host's
        least recently used blocks are written here and read back asynchronously.
    disk_tier_dir: where the disk tier's directory goes (None = the system temp directory); each
        worker process makes its own subdirectory and removes it at shutdown.
    host_tier_shared: keep the host tier in the node's shared memory (/dev/shm), one copy per node
        and model, shared by the node's workers and kept across a worker's restart
        (workers/kv/tiers/node.py); host_tier_bytes is then the node's budget. CPU workers only.
    host_tier_dir: the directory the shared host tier lives in (None = /dev/shm). A memory-backed
        filesystem (tmpfs) every worker of the node sees at the same path, e.g. a pod's
        ``emptyDir: {medium: Memory}`` mount; workers share a tier only when they name the same one.
    tier_policy: which block a full host tier gives up first: 'lru' (least recently used) or 'arc'
        (adaptive replacement: blocks used again outlast one-off prompts; pays where a few shared
        documents are asked about often, loses a little on plain chat histories, benchmarks/README.md).
        The disk tier and a node's shared tier give up their least recently used block.
    tier_load_timeout_s: a new request whose prefix continues on disk waits at most this long for
        the reads (outside the scheduler); then it recomputes what has not arrived.
    kv_cache_dtype: the KV cache's element type: 'auto', 'float32' or 'bfloat16'. 'bfloat16' under
        float32 activations (an int8 / q4 model, or dtype float32) on CPU halves the cache's bytes:
        twice the blocks in the same budget, and half the bytes decode attention reads per token
        (the larger part of a step's memory traffic at tens of sequences); keys and values are
        rounded to bf16 as they are written, scores and softmax stay fp32. 'auto': bfloat16 for an
        int8 / q4 model on CPU (its weights already trade that much precision for speed), else the
        activations' dtype. A float32 cache under bf16 activations is refused.
    """

    KEY_PREFIX: ClassVar[str] = "cache."  # how this type's messages spell its keys

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    host_tier_bytes: int | Literal["auto"] = "auto"
    disk_tier_bytes: int = 0
    disk_tier_dir: str | None = None
    host_tier_shared: bool = False
    host_tier_dir: str | None = None
    tier_policy: str = "lru"
    tier_load_timeout_s: float = 0.5
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"cache.block_size={self.block_size}: must be a power of two >= 1")
        if self.kv_cache_memory_bytes < 1 << 20:
            raise ConfigError(f"cache.kv_cache_memory_bytes={self.kv_cache_memory_bytes}: must be at least 1MiB "
                              "(e.g. 64MiB, 1GiB)")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"cache.num_blocks={self.num_blocks}: must be >= 2 (or unset)")
        host = self.host_tier_bytes
        if not (host == "auto" or (isinstance(host, int) and not isinstance(host, bool) and host >= 0)):
            raise ConfigError(f"cache.host_tier_bytes={host!r}: must be a size >= 0 (0 = off) or 'auto'")
        if self.disk_tier_bytes < 0:
            raise ConfigError(f"cache.disk_tier_bytes={self.disk_tier_bytes}: must be >= 0 (0 = off)")
        if self.disk_tier_bytes and host == 0:
            raise ConfigError(f"cache.disk_tier_bytes={self.disk_tier_bytes} with cache.host_tier_bytes=0: the disk "
                              "tier sits below the host tier; set host_tier_bytes too (e.g. 1GiB) or disk_tier_bytes to 0")
        sized = host not in (0, "auto")  # (disk over host 0 was refused above)
        if not self.enable_prefix_caching and (sized or self.disk_tier_bytes):
            key = f"cache.host_tier_bytes={host}" if sized else f"cache.disk_tier_bytes={self.disk_tier_bytes}"
            raise ConfigError(f"{key} with cache.enable_prefix_caching=false: the tiers keep prefix-cached blocks; "
                              "enable prefix caching or set host_tier_bytes and disk_tier_bytes to 0")
        if not isinstance(self.host_tier_shared, bool):
            raise ConfigError(f"cache.host_tier_shared={self.host_tier_shared!r}: must be true or false")
        if self.host_tier_shared and host == 0:
            raise ConfigError("cache.host_tier_shared=true with cache.host_tier_bytes=0: set the node tier's budget "
                              "in host_tier_bytes (e.g. 4GiB, or auto) or host_tier_shared to false")
        if self.host_tier_dir is not None and not (isinstance(self.host_tier_dir, str)
                                                   and self.host_tier_dir.startswith("/")):
            raise ConfigError(f"cache.host_tier_dir={self.host_tier_dir!r}: must be an absolute path (a tmpfs such "
                              "as /dev/shm) or unset")
        if self.tier_policy not in TIER_POLICIES:
            raise ConfigError(f"cache.tier_policy={self.tier_policy!r}: must be one of {', '.join(TIER_POLICIES)}")
        if self.tier_policy != "lru" and self.host_tier_shared:
            raise ConfigError(f"cache.tier_policy={self.tier_policy!r} with cache.host_tier_shared=true: the node's shared "
                              "tier gives up its least recently used block (its workers share no other order); set "
                              "tier_policy to lru or host_tier_shared to false")
        if not self.tier_load_timeout_s > 0:
            raise ConfigError(f"cache.tier_load_timeout_s={self.tier_load_timeout_s}: must be > 0 (seconds)")
        if self.kv_cache_dtype not in CACHE_DTYPES:
            raise ConfigError(f"cache.kv_cache_dtype={self.kv_cache_dtype!r}: must be one of {', '.join(CACHE_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget continuous batching.

    max_num_batched_tokens: tokens computed per step (decode tokens + prefill chunk tokens).
    max_num_seqs: sequences running at once (default: 64, or the token budget if smaller).
    target_itl_ms: None (default) = every step may take max_num_batched_tokens tokens; a number =
        prompt chunks are sized so a step takes about this many milliseconds after its decodes, by
        a cost model measured on this engine (workers/engine/token_budget.py), with
        max_num_batched_tokens still the cap: inter-token latency stays near the target under load,
        new prompts take more (smaller) steps.
    """

    KEY_PREFIX: ClassVar[str] = "scheduler."  # how this type's messages spell its keys

    max_num_batched_tokens: int = 512
    max_num_seqs: int | None = None
    target_itl_ms: float | None = None

    def __post_init__(self) -> None:
        if self.target_itl_ms is not None and (isinstance(self.target_itl_ms, bool)
                                               or not isinstance(self.target_itl_ms, (int, float))
                                               or not 0 < self.target_itl_ms < float("inf")):
            raise ConfigError(f"scheduler.target_itl_ms={self.target_itl_ms!r}: must be a number of milliseconds "
                              "> 0 (e.g. 50), or null for the fixed max_num_batched_tokens budget")
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", min(64, max(self.max_num_batched_tokens, 1)))
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1"
            )
        assert self.max_num_seqs is not None  # set just above
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            raise ConfigError(
                f"scheduler.max_num_seqs={self.max_num_seqs}: must be between 1 and "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """CUDA-graph capture sizes by default: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs
    (and max_num_seqs itself)."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def capture_sizes(enabled: bool, device: str, sizes: tuple[int, ...] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The CUDA-graph capture sizes a config implies (() when graphs are off); ConfigError naming
    the key for graphs on a CPU device, an empty list, or a size outside 1..max_num_seqs."""
    if not enabled:
        return ()
    if not (device.startswith("cuda") or device == "auto"):  # auto: checked again once resolved
        raise ConfigError(f"cuda_graphs=true needs device cuda (got device={device!r}); set cuda_graphs to false")
    if sizes is None:
        return default_capture_sizes(max_num_seqs)
    if not sizes:
        raise ConfigError("cuda_graph_batch_sizes=[]: must list at least one batch size (or be unset for the default)")
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ConfigError(f"cuda_graph_batch_sizes={list(sizes)}: {s!r} is not a batch size >= 1")
        if s > max_num_seqs:
            raise ConfigError(f"cuda_graph_batch_sizes={list(sizes)}: {s} is larger than scheduler.max_num_seqs "
                              f"({max_num_seqs}); a decode step never has more rows than that")
    return tuple(sorted(set(sizes)))


MIN_DRAFT_VOCAB = 256  # a pruned drafter head keeps at least the byte tokens' worth of ids


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (workers/spec_decode/): a proposer drafts tokens, the target verifies
    them all in one forward pass and keeps the longest correct prefix plus one token of its own.

    method: 'none', 'ngram' (prompt lookup: copy what followed the last n tokens' earlier
        occurrence; no model), or 'draft_model' (a small LM with the target's tokenizer in its own
        Ray actor, which Ray may place on a CPU-only node).
    num_speculative_tokens: the most tokens drafted per request per step (k).
    adaptive: pick each request's draft length from its running acceptance rate and the measured
        cost of a draft step vs a verify step (0 = plain decode when drafting does not pay).
    ngram_min / ngram_max: n-gram sizes the prompt-lookup proposer tries, longest first.
    draft_model / draft_quantization: the drafter's checkpoint and weight format.
    drafter_cpus / drafter_resources: what the drafter actor asks Ray for (custom resources place it,
        e.g. {'drafter': 1} on nodes started with that resource).
    draft_timeout_s: a drafter slower than this is dropped for the request (it continues without
        speculation and re-attaches when the drafter answers again).
    overlap: the drafter drafts the next window while the target verifies this one.
    draft_vocab_size: the drafter scores only this many of its tokenizer's most frequent tokens (a
        pruned LM head, workers/spec_decode/draft_vocab.py; output is unchanged); 0 = all.
    drafter_device: where the drafter runs: 'auto' (the target's device), 'cpu' or 'cuda'. A CPU
        drafter beside a GPU target is the heterogeneous pairing (e.g. on CPU-only nodes through
        drafter_resources); a drafter on another device than the target computes in float32 on CPU
        and in the target's dtype on CUDA (float32 when quantized).
    drafter_threads: compute threads of the drafter actor; 0 = its drafter_cpus. On a machine where
        target and drafter share the cores, overlap off and both using all cores (time sharing)
        can beat splitting the cores between them (benchmarks/README.md, spec_bench).
    drafter_pool: the name of a ``role: drafter`` pool (the cluster config's) whose replicas this
        pool's requests draft on: the router picks a replica per request (many targets share one,
        one target's requests spread over several) and each replica batches the rounds of every
        target. method must be draft_model, with draft_model unset (the drafter pool names its
        model); the draft_* and drafter_* settings above are then the pool's (``drafter`` section),
        except draft_timeout_s and overlap, which stay the target's. None: a private drafter actor
        per worker (draft_model), as above.
    """

    KEY_PREFIX: ClassVar[str] = "speculative."  # how this type's messages spell its keys

    method: str = "none"
    num_speculative_tokens: int = 4
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_quantization: str = "none"
    drafter_cpus: int = 1
    drafter_resources: tuple[tuple[str, float], ...] = ()
    draft_timeout_s: float = 2.0
    overlap: bool = True
    draft_vocab_size: int = 0
    drafter_threads: int = 0
    drafter_device: str = "auto"
    drafter_pool: str | None = None

    def __post_init__(self) -> None:
        if self.drafter_device not in DRAFTER_DEVICES:
            raise ConfigError(f"speculative.drafter_device={self.drafter_device!r}: must be one of "
                              f"{', '.join(DRAFTER_DEVICES)}")
        if isinstance(self.drafter_resources, dict):
            object.__setattr__(self, "drafter_resources", tuple(sorted(self.drafter_resources.items())))
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative.method={self.method!r}: must be one of {', '.join(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"speculative.num_speculative_tokens={self.num_speculative_tokens}: must be in 1..16")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"speculative.ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: "
                              "need 1 <= ngram_min <= ngram_max")
        if self.method == "draft_model" and not self.draft_model and not self.drafter_pool:
            raise ConfigError("speculative.method='draft_model' needs speculative.draft_model (a checkpoint dir "
                              "or model name with the target's tokenizer) or speculative.drafter_pool (a drafter "
                              "pool's name)")
        if self.drafter_pool is not None and self.method != "draft_model":
            raise ConfigError(f"speculative.drafter_pool={self.drafter_pool!r}: needs speculative.method='draft_model', "
                              f"not {self.method!r}")
        if self.drafter_pool is not None and self.draft_model:
            raise ConfigError(f"speculative.draft_model={self.draft_model!r}: unset it with speculative.drafter_pool="
                              f"{self.drafter_pool!r} (the drafter pool names its model)")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ConfigError(f"speculative.draft_quantization={self.draft_quantization!r}: must be one of "
                              f"{', '.join(QUANTIZATIONS)}")
        if self.drafter_cpus < 1:
            raise ConfigError(f"speculative.drafter_cpus={self.drafter_cpus}: must be >= 1")
        if not all(isinstance(k, str) and k.strip() and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and 0 < v < float("inf") for k, v in self.drafter_resources):
            raise ConfigError(f"speculative.drafter_resources={dict(self.drafter_resources)!r}: must map Ray "
                              "resource names to amounts > 0, e.g. {drafter: 1}")
        if not self.draft_timeout_s > 0:
            raise ConfigError(f"speculative.draft_timeout_s={self.draft_timeout_s}: must be > 0 seconds")
        if self.draft_vocab_size != 0 and self.draft_vocab_size < MIN_DRAFT_VOCAB:
            raise ConfigError(f"speculative.draft_vocab_size={self.draft_vocab_size}: must be 0 (the full vocabulary) "
                              f"or >= {MIN_DRAFT_VOCAB}, e.g. 32768")
        if self.drafter_threads < 0:
            raise ConfigError(f"speculative.drafter_threads={self.drafter_threads}: must be >= 0 (0 = drafter_cpus)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def drafter_placement(self, target_device: str, target_dtype: str) -> tuple[str, str]:
        """(device, dtype) of the drafter for a target on target_device / target_dtype."""
        if self.drafter_device == "auto" or target_device.split(":")[0] == self.drafter_device:
            device = target_device
        else:
            device = self.drafter_device
        if device == "cpu" or self.draft_quantization != "none":
            return device, "float32"  # a CPU drafter keeps float32; quantized layers run float32 activations
        return device, target_dtype


@dataclass(frozen=True)
class DrafterConfig:
    """What each replica of a drafter pool runs (``role: drafter`` pools; workers/spec_decode/): one
    continuous-batching DraftEngine serving the draft rounds of every target routed to it.

    model: the draft checkpoint or model name; it must share the target's tokenizer (``duet serve``
        refuses one that does not, naming both models).
    quantization: the drafter's weights: none | int8 | q4 (quantized runs float32 activations).
    threads: torch threads of a replica; 0 = the CPUs it reserves (the pool's cpus_per_replica).
    draft_vocab_size: score only this many of the tokenizer's most frequent tokens (a pruned LM head,
        workers/spec_decode/draft_vocab.py; output unchanged); 0 = all.
    idle_timeout_s: a request with no round for this long is freed (its target died, or it moved
        somewhere that never came back); finished and aborted requests are freed at once.
    The replica's device, KV budget and block size are the pool's ``engine`` settings.
    """

    KEY_PREFIX: ClassVar[str] = "drafter."  # how this type's messages spell its keys

    model: str | None = None
    quantization: str = "none"
    threads: int = 0
    draft_vocab_size: int = 0
    idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.model is not None and not self.model.strip():
            raise ConfigError(f"drafter.model={self.model!r}: must name a model or a checkpoint directory (or null)")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"drafter.quantization={self.quantization!r}: must be one of {', '.join(QUANTIZATIONS)}")
        if self.threads < 0:
            raise ConfigError(f"drafter.threads={self.threads}: must be >= 0 (0 = the CPUs a replica reserves)")
        if self.draft_vocab_size != 0 and self.draft_vocab_size < MIN_DRAFT_VOCAB:
            raise ConfigError(f"drafter.draft_vocab_size={self.draft_vocab_size}: must be 0 (the full vocabulary) "
                              f"or >= {MIN_DRAFT_VOCAB}, e.g. 32768")
        if not self.idle_timeout_s > 0:
            raise ConfigError(f"drafter.idle_timeout_s={self.idle_timeout_s}: must be > 0 seconds")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served on the base model's weights (workers/lora/).

    enabled: accept requests that name an adapter, and the adapter admin RPCs. Off (the default),
        the model has no LoRA buffers and no step pays for them; a request naming an adapter is
        refused (FAILED_PRECONDITION).
    max_loaded: the most adapters this worker holds at once (its adapter slots); loading one more
        evicts the least recently used adapter that is neither pinned nor in use.
    max_rank: the largest adapter rank accepted; every slot is sized for it (an adapter of a smaller
        rank is zero-padded), so the buffers hold max_loaded * max_rank * (in + out) weights per
        targeted projection.
    """

    KEY_PREFIX: ClassVar[str] = "lora."  # how this type's messages spell its keys

    enabled: bool = False
    max_loaded: int = 8
    max_rank: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"lora.enabled={self.enabled!r}: must be true or false")
        for key, value, top in (("max_loaded", self.max_loaded, 256), ("max_rank", self.max_rank, 256)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ConfigError(f"lora.{key}={value!r}: must be an integer in 1..{top}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs.

    model: a local HF checkpoint directory or the alias of an embedded model
        ('SmolLM2-135M-Instruct').
    device: 'auto' (cuda when this process holds GPUs - a Ray rank the GPUs Ray assigned it, any
        other process the GPUs torch sees - else cpu), 'cpu' or 'cuda[:N]'; resolved once at engine
        start by workers/engine/device.py, and 'cuda' on a node without CUDA is refused there.
    dtype: 'auto' (the checkpoint's torch_dtype on CUDA; float32 with quantization; on CPU bfloat16
        where the CPU has AVX512-BF16 or AMX, else float32), float32, bfloat16 or float16. On such a
        CPU the C++ kernels and oneDNN's bf16 GEMM run bf16 natively (workers/engine/device.py,
        kernels/cpu_features.py); an explicit bfloat16 runs on any x86-64 CPU, slower without them.
    max_model_len: context limit (prompt + output); None = the model's own limit.
    quantization: weights of the decoder's linear layers: 'none' (dtype), 'int8' (per-output-channel
        scales) or 'q4' (4-bit blocks of 32, GGUF Q4_1 math; a GGUF-sourced model loads its 4-bit
        tensors directly). Quantized layers need dtype float32 activations. See
        workers/layers/quant_linear.py.
    speculative: speculative decoding (see SpeculativeConfig); off by default. The drafter runs
        with the target's dtype on the target's device, in float32 on CPU or when quantized
        (SpeculativeConfig.drafter_placement); an explicit non-float32 dtype with a quantized
        drafter is refused.
    fused_decode: decode-only steps of an eligible model run through the fused C++ decoder stack
        (workers/models/decode_stack.py; bit-identical to the module path); False for A/B runs.
    cpu_kernels: the C++ CPU kernels (kernels/_build.py); False makes every op use its torch
        reference. Applied to the whole worker process when the engine is built.
    cuda_graphs: replay decode-only steps from CUDA graphs captured at start (workers/engine/cuda_graphs.py;
        device cuda only, tensor parallel 1).
    cuda_graph_batch_sizes: the batch sizes to capture (each in 1..scheduler.max_num_seqs); None =
        1, 2, 4, 8 and multiples of 8 up to max_num_seqs. A batch between two sizes is padded up.
    kv_transfer_backend: how KV this worker receives (disaggregated prefill, prefix pull) travels:
        'auto' (shared memory from a peer on the same host when the KV cache is on the CPU, else
        nccl on CUDA, else gloo), or forced 'shm' | 'gloo' | 'nccl' (nccl needs the cache on CUDA);
        see workers/kv/transfer.py.
    shared_weights_dir: a node-local directory where the first worker of a node writes its loaded
        weights once and every other worker maps them (workers/models/shared_weights.py): later
        replicas load in milliseconds and the node holds one copy; None = each worker loads its own.
    omp_wait_policy: what an idle OpenMP thread of the worker process does (set in its environment
        at start, workers/server/threads.py): 'passive' (default) sleeps at once, so a thread the
        OS descheduled (another process took its core) never leaves the others spinning at every
        barrier; 'active' spins (a little lower latency per parallel region where every worker
        owns its cores outright); 'runtime' leaves the OpenMP runtime's default (libgomp: spin
        ~300k iterations first) or what the environment already says.
    lora: LoRA adapters (see LoraConfig); off by default. Needs one-rank workers (tp, sp and ep size 1)
        and no CUDA graphs (refused at the config edge and at engine start, workers/lora/attach.py,
        naming both keys).
    niceness: the worker process's nice value (0 default; None = Ray's default for worker processes,
        15, under which the router, Ray's daemons and any other process preempt the engine).
        Lowering a process's niceness below its parent's needs CAP_SYS_NICE (root); duet serve
        starts each worker with it (Ray's RAY_worker_niceness in the actor's runtime_env).
    prepack_weights: bf16 linear layers and LM head on the CPU keep oneDNN's blocked (AMX /
        AVX512-BF16) copy of their weights, made once at load, for batches past the bf16 GEMV's 8
        rows (kernels/linear.py ``prepack``): ``F.linear`` on a plain bf16 weight reorders it on every
        call. The results are oneDNN's GEMM's either way; the cost is a second copy of those weights
        in memory (true by default; false: one copy, the per-call reorder).
    quantized_batches: how a quantized model (int8, q4) on the CPU runs more than 64 prompt rows in a
        step (decode rows, plain or speculative verify, always take the quantized kernels, so a
        request's numbers do not depend on what shares its step):
        'kernel' on the quantized kernels; 'bf16' on a oneDNN-packed bf16 copy of each layer's
        de-quantized weight (the same values to bf16's 8 significant bits, 2 more bytes per weight
        of memory; workers/layers/quant_linear.py); 'auto' (default) = 'bf16' where the CPU has AMX,
        whose bf16 GEMM does ~3x the int8 dot's work per second, else 'kernel'.
    memory_tuning: how the worker process uses host memory (true by default; workers/server/threads.py):
        transparent huge pages for the CPU KV cache and for the heap, and a heap that keeps large
        freed blocks for reuse (glibc malloc tunables in the process's environment at start), so the
        scattered KV reads of decode attention and the weight reads of the linear layers miss the
        TLB less, and a step's large temporaries (logits, sampling) are not unmapped and faulted in
        again every step. false = the system's defaults (and a GLIBC_TUNABLES of your own).
    """

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    quantization: str = "none"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    fused_decode: bool = True
    cpu_kernels: bool = True
    cuda_graphs: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    kv_transfer_backend: str = "auto"
    shared_weights_dir: str | None = None
    omp_wait_policy: str = "passive"
    niceness: int | None = 0
    memory_tuning: bool = True
    prepack_weights: bool = True
    quantized_batches: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # from YAML (cluster/config/duet.py EngineSection) or a JSON config
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if isinstance(self.cuda_graph_batch_sizes, list):
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(self.cuda_graph_batch_sizes))
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"model={self.model!r}: must name a model ('SmolLM2-135M-Instruct') or a checkpoint "
                              "directory")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r}: must be one of {', '.join(QUANTIZATIONS)}")
        if self.quantization != "none" and self.dtype not in ("float32", "auto"):
            raise ConfigError(f"quantization={self.quantization!r} with dtype={self.dtype!r}: quantized weights "
                              "run with float32 activations; set dtype to float32 or quantization to none")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be auto or one of {', '.join(DTYPES)}")
        draft_q = self.speculative.draft_quantization
        if self.speculative.method == "draft_model" and draft_q != "none" and self.dtype not in ("float32", "auto"):
            raise ConfigError(f"speculative.draft_quantization={draft_q!r} with dtype={self.dtype!r}: the drafter "
                              "runs with the target's dtype and quantized weights need float32 activations; set "
                              "dtype to float32 (or auto) or draft_quantization to none")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 2 (or unset)")
        self._check_cache_dtype()
        if not (self.device in ("auto", "cpu") or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ConfigError(f"device={self.device!r}: must be 'auto', 'cpu' or 'cuda[:N]'")
        assert self.scheduler.max_num_seqs is not None  # SchedulerConfig.__post_init__ sets it
        capture_sizes(self.cuda_graphs, self.device, self.cuda_graph_batch_sizes, self.scheduler.max_num_seqs)
        if self.kv_transfer_backend not in KV_BACKENDS:
            raise ConfigError(f"kv_transfer_backend={self.kv_transfer_backend!r}: must be one of {', '.join(KV_BACKENDS)}")
        if self.shared_weights_dir is not None and not str(self.shared_weights_dir).strip():
            raise ConfigError("shared_weights_dir='': must be a directory path, or unset to load a copy per worker")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ConfigError(f"omp_wait_policy={self.omp_wait_policy!r}: must be one of {', '.join(OMP_WAIT_POLICIES)}")
        if self.niceness is not None and (isinstance(self.niceness, bool) or not isinstance(self.niceness, int)
                                          or not -20 <= self.niceness <= 19):
            raise ConfigError(f"niceness={self.niceness!r}: must be an integer in [-20, 19] (0 = normal priority), "
                              "or null for Ray's default (15)")
        if self.quantized_batches not in QUANTIZED_BATCHES:
            raise ConfigError(f"quantized_batches={self.quantized_batches!r}: must be one of "
                              f"{', '.join(QUANTIZED_BATCHES)}")
        for key in ("memory_tuning", "prepack_weights"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r}: must be true or false")
        if self.lora.enabled and self.cuda_graphs:
            raise ConfigError("lora.enabled=true with cuda_graphs=true: the captured decode graphs hold no LoRA "
                              "step; set cuda_graphs to false or lora.enabled to false")
        if self.kv_transfer_backend == "nccl" and self.device == "cpu":
            raise ConfigError("kv_transfer_backend='nccl' with device='cpu': nccl moves KV between GPUs; use auto, "
                              "shm or gloo, or device cuda")
        if self.cache.host_tier_shared and self.device.startswith("cuda"):
            raise ConfigError(f"cache.host_tier_shared=true with device={self.device!r}: the node's shared host tier "
                              "is for CPU workers (a GPU worker's host tier is its own pinned memory); set device "
                              "to cpu or host_tier_shared to false")

    @property
    def graph_capture_sizes(self) -> tuple[int, ...]:
        """The CUDA-graph capture sizes (() when cuda_graphs is off)."""
        assert self.scheduler.max_num_seqs is not None  # SchedulerConfig.__post_init__ sets it
        return capture_sizes(self.cuda_graphs, self.device, self.cuda_graph_batch_sizes, self.scheduler.max_num_seqs)

    @property
    def resolved(self) -> bool:
        """device and dtype name concrete values (not 'auto'; see workers/engine/device.py)."""
        return self.device != "auto" and self.dtype != "auto"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        # Engines resolve 'auto' first (workers/engine/device.py, resolve_for_process); a config used without
        # a checkpoint (a bare ModelRunner in tests) takes float32, what 'auto' gives on CPU.
        return torch.float32 if self.dtype == "auto" else getattr(torch, self.dtype)

    def _check_cache_dtype(self) -> None:
        """cache.kv_cache_dtype against the activations (checked again once device and dtype are resolved)."""
        kv, act = self.cache.kv_cache_dtype, self.dtype
        if kv == "auto" or act == "auto" or kv == act:
            return
        if not (kv == "bfloat16" and act == "float32"):
            raise ConfigError(f"cache.kv_cache_dtype={kv!r} with dtype={act!r}: the KV cache is the activations' dtype "
                              "or, under float32 activations, bfloat16; set cache.kv_cache_dtype to auto")
        if self.device.startswith("cuda"):
            raise ConfigError(f"cache.kv_cache_dtype={kv!r} with dtype={act!r} on device={self.device!r}: a bf16 cache "
                              "under float32 activations is a CPU option (the GPU kernels take one dtype); set "
                              "cache.kv_cache_dtype to auto or dtype to bfloat16")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type: cache.kv_cache_dtype; for 'auto' bfloat16 under a quantized
        model's float32 activations on CPU, else the activations' (torch_dtype)."""
        import torch

        if self.cache.kv_cache_dtype != "auto":
            return getattr(torch, self.cache.kv_cache_dtype)
        if self.quantization != "none" and self.device == "cpu" and self.torch_dtype is torch.float32:
            return torch.bfloat16
        return self.torch_dtype


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of a gang's mesh axes (workers/parallel/groups.py); the gang has ep_size * sp_size *
    tp_size ranks. comm: how same-host CPU collectives travel: 'auto' (shared memory where every
    rank of a group is on one host, else the process group's backend), 'shm' (refuse to start
    unless every group gets shared memory) or 'gloo' (the process group's own collectives only, for
    comparison)."""

    ep_size: int = 1
    sp_size: int = 1
    tp_size: int = 1
    comm: str = "auto"

    def __post_init__(self) -> None:
        for axis in PARALLEL_AXES:
            size = getattr(self, f"{axis}_size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"{axis}_size={size!r}: must be an integer >= 1")
        if self.comm not in COMM_MODES:
            raise ConfigError(f"comm={self.comm!r}: must be one of {', '.join(COMM_MODES)}")

    @property
    def world_size(self) -> int:
        return self.ep_size * self.sp_size * self.tp_size
