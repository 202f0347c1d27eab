"""RouterConfig: everything the router process needs, validated once at construction.

Terms:
    in flight   requests the router is streaming from a worker right now.
    queue       admitted requests waiting for an in-flight slot (FIFO). A request arriving when
                both are full gets RESOURCE_EXHAUSTED at once; it never waits for room.
    poll        one GetLoad + health Check round trip to a worker; ``load_poll_interval_s`` apart.

Sampling defaults fill the *unset* optional fields of a public request (duet.v1.SamplingParams):
``default_max_tokens`` 16 (the value the public proto documents), temperature 1.0, top_p 1.0.
A prompt plus max_tokens may exceed the context: the completion then ends with LENGTH at the
context limit (max_tokens is clamped before the worker sees it), as the public proto documents.

Example::

    cfg = RouterConfig(tokenizer_path="~/.cache/duet/models/SmolLM2-135M-Instruct",
                       model_name="SmolLM2-135M-Instruct", policy="least_loaded")
    RouterConfig(tokenizer_path="x", port=70000)
    # RouterConfigError: port=70000: must be in 0..65535 (0 picks a free port)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from router.policies import DEFAULT_POLICY, PolicyConfigError, make_policy
from router.policies.drafter import DEFAULT_DRAFTER_POLICY, DRAFTER_POLICIES, make_drafter_policy

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class RouterConfigError(ValueError):
    """A RouterConfig value is invalid; the message names the field and what to change."""


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@/+-]*$")


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter registered on a base model (router/adapters.py).

    name: what requests name: the adapter alone, or "<base model>:<name>" (letters, digits and
        ._-@/+, no ':'; unique in the deployment, and no model's name).
    source: where its PEFT files are (a directory holding adapter_config.json and
        adapter_model.safetensors, on every worker's node; or a Hub id where a hub is reachable).
        Workers load it from there on its first request.
    pinned: workers never evict it from their bounded adapter set (LRU); it still counts against it.
    """

    name: str
    source: str
    pinned: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            _fail("name", self.name, "must be letters, digits and ._-@/+ (no ':' and no spaces), e.g. sql-lora")
        if not isinstance(self.source, str) or not self.source.strip():
            _fail("source", self.source, "must be the adapter's directory (adapter_config.json + "
                  "adapter_model.safetensors) or a Hub id")
        if not isinstance(self.pinned, bool):
            _fail("pinned", self.pinned, "must be true or false")


@dataclass(frozen=True)
class ModelSpec:
    """One model a router serves, beside its default (RouterConfig.models).

    name: the served name (what GenerateRequest.model and HTTP ``model`` select).
    tokenizer_path: its checkpoint (or tokenizer) directory.
    max_model_len: its context limit; None = the checkpoint's.
    adapters: LoRA adapters registered on it from config (AdapterSpec).
    adapter_dir: a directory the router watches: each subdirectory holding an adapter_config.json
        is an adapter of this model named after the subdirectory (rescanned on lookups, at most
        every few seconds); None = none. Every router and worker must see the same path.
    """

    name: str
    tokenizer_path: str
    max_model_len: int | None = None
    adapters: tuple[AdapterSpec, ...] = ()
    adapter_dir: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if not isinstance(self.name, str) or not self.name.strip() or ":" in self.name:
            _fail("name", self.name, "must be a non-empty name without ':' (what GenerateRequest.model accepts; "
                  "'<model>:<adapter>' names an adapter)")
        if not isinstance(self.tokenizer_path, str) or not self.tokenizer_path:
            _fail("tokenizer_path", self.tokenizer_path, "must be a local tokenizer/checkpoint directory")
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 2, " (or None to read it from the checkpoint)")
        if self.adapter_dir is not None and (not isinstance(self.adapter_dir, str) or not self.adapter_dir.strip()):
            _fail("adapter_dir", self.adapter_dir, "must be a directory of adapter subdirectories, or null")
        names = [a.name for a in self.adapters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            _fail("adapters", names, f"adapter names must be unique; {', '.join(dup)} listed twice")


@dataclass(frozen=True)
class RouterConfig:
    """Router settings. ``tokenizer_path`` is a local directory ``AutoTokenizer`` can load
    (normally the model checkpoint the workers serve).

    max_model_len: context limit (prompt + output) checked before routing; None = the checkpoint's
        ``config.json`` ``max_position_embeddings`` (else the tokenizer's ``model_max_length``).
        Set it to the workers' effective limit when their KV budget makes it smaller.
    adapters / adapter_dir: the default model's LoRA adapters (ModelSpec).
    models: further models served beside the default one (``served_models`` lists all, default
        first); every name (model or adapter) must be unique.
    policy / policy_options: a routing policy from router.policies and its keyword options.
    drafter_policy / drafter_policy_options: how a speculative request's drafter replica is picked
        from the drafter pool its worker names (router/policies/drafter.py): least_loaded_affinity
        (option fanout: the replicas one target spreads its requests over, default 4).
    max_route_attempts: workers tried per request when a worker is unreachable or its own queue
        is full *before the first token*.
    resume_on_worker_failure / max_resumes: a worker that dies *after* the first token: the
        request resumes on another healthy worker from prompt + streamed tokens (greedy output
        unchanged), at most max_resumes times; off (or exhausted), the stream ends with a
        retryable UNAVAILABLE.
    worker_wait_s: how long a request (new, retried or resuming) waits for a healthy worker when
        none is, while some worker it has not failed on may come back (e.g. restarting); within
        its deadline and holding its admission slot. 0 = fail at once with UNAVAILABLE.
    wake_timeout_s: how long a request is held while the controller wakes a pool scaled to zero
        (router/hold.py: held in arrival order, within its deadline); past it the request fails with
        UNAVAILABLE (HTTP 503) naming the wait.
    worker_failure_threshold: consecutive failed polls before a worker is marked unhealthy.
    stream_failure_cooldown_s: after a worker's stream fails, it is not re-admitted by a
        successful poll until this long has passed (stops a flapping worker taking traffic).
    """

    tokenizer_path: str
    model_name: str = DEFAULT_MODEL_NAME
    max_model_len: int | None = None
    # LoRA adapters of the default model (router/adapters.py) and its watched adapter directory.
    adapters: tuple[AdapterSpec, ...] = ()
    adapter_dir: str | None = None
    # Further models this router serves beside the default one (model_name / tokenizer_path):
    # requests select one by GenerateRequest.model; each worker member names its model.
    models: tuple[ModelSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # The OpenAI-compatible HTTP API (router/http/) on the same host; 0 = off. Same TLS and tokens.
    http_port: int = DEFAULT_HTTP_PORT
    policy: str = DEFAULT_POLICY
    policy_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    drafter_policy: str = DEFAULT_DRAFTER_POLICY
    drafter_policy_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # Admission control.
    max_in_flight: int = 128
    max_queue: int = 512
    # Sampling defaults for unset optional fields.
    default_max_tokens: int = 16
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    # Request limits (the public proto documents these).
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    # GenerateRequest.n: most choices one request may ask for (router/fanout.py).
    max_n: int = 16
    # Workers.
    load_poll_interval_s: float = 0.2
    load_poll_timeout_s: float = 2.0
    # Keep each worker's WatchBlocks stream open (router/block_watch.py): its prefix-cache block events,
    # pending prompts included, arrive as they happen rather than with the next poll; false = the
    # poll alone (a worker without WatchBlocks is polled either way).
    watch_block_events: bool = True
    # Send a worker's requests on one SubmitStream (router/submit_mux.py: the worker sends one message
    # per step for all of them); false = one Submit call per request (the plain path).
    multiplex_worker_streams: bool = True
    worker_failure_threshold: int = 3
    stream_failure_cooldown_s: float = 1.0
    max_route_attempts: int = 2
    # A worker dying after tokens were streamed: continue on another worker (router/pipeline.py).
    resume_on_worker_failure: bool = True
    max_resumes: int = 2
    worker_wait_s: float = 10.0
    wake_timeout_s: float = 60.0
    # Disaggregation (router/policies/disagg.py; only with prefill-role workers in the membership):
    # prompts shorter than this run colocated on the decode worker; the workers' KV block size.
    disagg_min_prompt_tokens: int = 256
    disagg_block_size: int = 16
    # Prefix pull (router/policies/prefix_pull.py): a colocated route to a worker lacking at least this many
    # leading prompt tokens that another worker holds has it pull their KV blocks from that worker
    # instead of recomputing them. 0 = off.
    prefix_pull_min_tokens: int = 0
    # Shutdown: seconds in-flight streams get to finish on stop().
    shutdown_grace_s: float = 5.0
    # Membership: host:port of the controller's duet.control.v1.Membership service. Set, the router
    # follows the controller's member list (router/membership.py); None, members are set directly.
    membership_address: str | None = None
    # How long start waits for the controller's first member list before serving without it.
    membership_wait_s: float = 10.0
    # Security (router/security.py): TLS cert + key (PEM) turn TLS on; a client CA as well requires
    # client certificates (mTLS); a tokens file requires 'authorization: Bearer <token>'.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    auth_tokens_file: str | None = None
    # Largest request message accepted (bytes); larger ones end with RESOURCE_EXHAUSTED unread.
    max_request_bytes: int = 4 << 20
    # Rebalancer (router/rebalancer.py): every rebalance_interval_s, when a pool's decode workers'
    # KV usage differs by more than rebalance_kv_gap (a fraction) or their TPOT by more than
    # rebalance_tpot_ratio (x), move one running request from the hottest to the coolest by live KV
    # migration; a moved request stays put for rebalance_request_cooldown_s. Off by default.
    rebalance: bool = False
    rebalance_interval_s: float = 2.0
    rebalance_kv_gap: float = 0.3
    rebalance_tpot_ratio: float = 2.0
    rebalance_request_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy_options", MappingProxyType(dict(self.policy_options)))
        object.__setattr__(self, "drafter_policy_options", MappingProxyType(dict(self.drafter_policy_options)))
        if not isinstance(self.tokenizer_path, str) or not self.tokenizer_path:
            _fail("tokenizer_path", self.tokenizer_path, "must be a local tokenizer/checkpoint directory")
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            _fail("model_name", self.model_name, "must be a non-empty name (what GenerateRequest.model accepts)")
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 2, " (or None to read it from the checkpoint)")
        object.__setattr__(self, "adapters", tuple(self.adapters))
        object.__setattr__(self, "models", tuple(self.models))
        self._check_models()
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            _fail("port", self.port, "must be in 0..65535 (0 picks a free port)")
        if not isinstance(self.http_port, int) or isinstance(self.http_port, bool) or not 0 <= self.http_port <= 65535:
            _fail("http_port", self.http_port, "must be in 0..65535 (0 turns the HTTP API off)")
        if self.http_port and self.http_port == self.port:
            _fail("http_port", self.http_port, f"must differ from port={self.port} (the gRPC port)")
        if not isinstance(self.host, str) or not self.host:
            _fail("host", self.host, "must be a host name or address, e.g. 127.0.0.1 or 0.0.0.0")
        try:
            make_policy(self.policy, **self.policy_options)
        except PolicyConfigError as e:
            if str(e).startswith("unknown routing policy"):
                _fail("policy", self.policy, str(e))
            _fail("policy_options", dict(self.policy_options), str(e))
        try:
            make_drafter_policy(self.drafter_policy, **self.drafter_policy_options)
        except PolicyConfigError as e:
            if self.drafter_policy not in DRAFTER_POLICIES:
                _fail("drafter_policy", self.drafter_policy, str(e))
            _fail("drafter_policy_options", dict(self.drafter_policy_options), str(e))
        _int_at_least("max_in_flight", self.max_in_flight, 1)
        _int_at_least("max_queue", self.max_queue, 0, " (0 = reject whenever max_in_flight is reached)")
        _int_at_least("default_max_tokens", self.default_max_tokens, 1)
        if not _finite(self.default_temperature) or self.default_temperature < 0:
            _fail("default_temperature", self.default_temperature, "must be a finite number >= 0")
        if not _finite(self.default_top_p) or not 0 < self.default_top_p <= 1:
            _fail("default_top_p", self.default_top_p, "must be in (0, 1]")
        _int_at_least("max_stop_strings", self.max_stop_strings, 0)
        _int_at_least("max_stop_string_len", self.max_stop_string_len, 1)
        _int_at_least("max_n", self.max_n, 1)
        if not isinstance(self.watch_block_events, bool):
            _fail("watch_block_events", self.watch_block_events, "must be true or false")
        if not isinstance(self.multiplex_worker_streams, bool):
            _fail("multiplex_worker_streams", self.multiplex_worker_streams, "must be true or false")
        for name in ("load_poll_interval_s", "load_poll_timeout_s"):
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                _fail(name, value, "must be a positive number of seconds")
        for name in ("stream_failure_cooldown_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                _fail(name, value, "must be a number of seconds >= 0")
        if self.membership_address is not None and (not isinstance(self.membership_address, str)
                                                    or not _is_host_port(self.membership_address)):
            _fail("membership_address", self.membership_address, "must be the controller's host:port, "
                  "e.g. 10.0.0.2:50052 (or None to set members directly)")
        if not _finite(self.membership_wait_s) or self.membership_wait_s < 0:
            _fail("membership_wait_s", self.membership_wait_s, "must be a number of seconds >= 0")
        _int_at_least("worker_failure_threshold", self.worker_failure_threshold, 1)
        _int_at_least("max_route_attempts", self.max_route_attempts, 1)
        _int_at_least("max_resumes", self.max_resumes, 0)
        if not _finite(self.worker_wait_s) or self.worker_wait_s < 0:
            _fail("worker_wait_s", self.worker_wait_s, "must be a number of seconds >= 0")
        if not _finite(self.wake_timeout_s) or self.wake_timeout_s < 0:
            _fail("wake_timeout_s", self.wake_timeout_s, "must be a number of seconds >= 0")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            _fail("tls_cert_file" if self.tls_cert_file is None else "tls_key_file", None,
                  "TLS needs both tls_cert_file and tls_key_file (PEM); set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            _fail("tls_client_ca_file", self.tls_client_ca_file,
                  "client certificates (mTLS) need TLS: set tls_cert_file and tls_key_file too")
        _int_at_least("max_request_bytes", self.max_request_bytes, 1024)
        if not isinstance(self.rebalance, bool):
            _fail("rebalance", self.rebalance, "must be true or false")
        for name in ("rebalance_interval_s", "rebalance_request_cooldown_s"):
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                _fail(name, value, "must be a positive number of seconds")
        if not _finite(self.rebalance_kv_gap) or not 0 < self.rebalance_kv_gap < 1:
            _fail("rebalance_kv_gap", self.rebalance_kv_gap, "must be in (0, 1): a difference of KV usage fractions")
        if not _finite(self.rebalance_tpot_ratio) or self.rebalance_tpot_ratio <= 1:
            _fail("rebalance_tpot_ratio", self.rebalance_tpot_ratio, "must be > 1 (hot TPOT / cool TPOT)")
        _int_at_least("disagg_min_prompt_tokens", self.disagg_min_prompt_tokens, 0)
        _int_at_least("disagg_block_size", self.disagg_block_size, 1)
        _int_at_least("prefix_pull_min_tokens", self.prefix_pull_min_tokens, 0, " (0 = off)")

    def _check_models(self) -> None:
        default = ModelSpec(self.model_name, self.tokenizer_path, self.max_model_len, self.adapters, self.adapter_dir)
        seen: dict[str, str] = {}
        for m in (default, *self.models):
            if not isinstance(m, ModelSpec):
                _fail("models", m, "must hold router.config.ModelSpec entries")
            for name, what in ((m.name, "model"), *((a.name, f"adapter of {m.name}") for a in m.adapters)):
                if name in seen:
                    _fail("models", name, f"the name is used twice ({seen[name]} and {what}); model and adapter "
                          "names must be unique in a deployment")
                seen[name] = what

    @property
    def served_models(self) -> tuple[ModelSpec, ...]:
        """Every model this router serves, the default (``model_name``) first."""
        return (ModelSpec(self.model_name, self.tokenizer_path, self.max_model_len, self.adapters, self.adapter_dir),
                *self.models)

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def address(self) -> str:
        """host:port to bind (IPv6 literals bracketed)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    @property
    def http(self) -> bool:
        """Whether the router serves the OpenAI-compatible HTTP API (``http_port`` > 0)."""
        return self.http_port != 0


def _fail(name: str, value: object, what: str) -> None:
    raise RouterConfigError(f"{name}={value!r}: {what}")


def _int_at_least(name: str, value: object, low: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(name, value, f"must be an integer >= {low}{hint}")


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) <= 65535)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
