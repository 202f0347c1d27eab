"""Python client for a Duet router (duet.v1 over gRPC).

Async, streaming::

    async with DuetClient("localhost:50051") as client:
        async for chunk in client.generate("The capital of France is", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        # the last chunk has chunk.finish_reason ("stop" | "length" | "abort") and chunk.usage

Sync::

    text = generate_text("Write a haiku about gRPC", max_tokens=64)
    result = complete(messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0)
    for chunk in stream("Once upon a time", max_tokens=100): ...

The prompt is exactly one of ``prompt`` (text, no chat template), ``token_ids`` or ``messages``
(the router applies the model's chat template). Sampling keywords mirror duet.v1.SamplingParams:
``max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos,
num_speculative_tokens, presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens,
logit_bias`` (a dict token id -> bias) ``, top_logprobs`` (then every chunk has ``logprobs``, one
TokenLogprob per token id); unset ones take the server's defaults. ``n`` asks for several choices:
chunks carry ``index``, and ``collect_choices`` joins them per choice::

    choices = collect_choices(stream("Name a colour:", n=4, seed=1, max_tokens=8))

``structured=StructuredOutput(...)`` constrains the output (``StructuredOutput`` is exported here;
it is workers/structured/spec.py's, which the router and the engine share).
 ``timeout`` (seconds) is the request's gRPC deadline. A failed request
raises DuetError with the gRPC status code and the server's message (which names the bad field).

Retries: RESOURCE_EXHAUSTED (the router's admission queue is full) and UNAVAILABLE (no healthy
worker, or the router is restarting) *before the first token* are retried by gRPC itself with
exponential backoff, ``retries=3`` times by default (``retry_options``; ``retries=0`` turns it off).

Several routers (``target`` a list, e.g. every router of ``duet serve --routers 3``): when the
router carrying a stream dies or drains mid-stream (UNAVAILABLE or CANCELLED from the server), the
client sends the same request to the next router with ``resume`` = the token ids and the text it
already received (duet.v1.ResumeFrom), up to ``max_resumes`` times; the stream goes on at the exact
token index, without a gap or a repeat, and under greedy sampling or a seed with the same tokens an
unbroken stream gets (the router continues from prompt + those tokens; the worker's seeded generator
skips the draws already made). Before the first token a dead router's request simply goes to the
next one. A router that drains (SIGTERM) hands its remaining streams off the same way, marked so
(trailing metadata ``duet-handoff``) that the client resumes them even with one target: behind a
Kubernetes Service the next connection reaches another router. Requests with ``n`` > 1 are not
resumed mid-stream (their error reaches the caller)::

    async with DuetClient(["10.0.0.3:50051", "10.0.0.4:50051"]) as client: ...
    text = generate_text("Hi", target=["localhost:50051", "localhost:50052"], seed=7, temperature=0.8)

A router with TLS, mTLS or bearer tokens (router/security.py)::

    tls = ClientTLS(ca_file="ca.pem")                                   # TLS: trust this CA
    tls = ClientTLS(ca_file="ca.pem", cert_file="me.pem", key_file="me.key")   # mTLS
    async with DuetClient("duet.example.com:443", tls=tls, token="s3cr3t") as client: ...
    generate_text("Hi", target="duet.example.com:443", tls=tls, token="s3cr3t")

Install it without the server: ``pip install ./clients/python`` (the ``duet-client`` distribution:
grpcio, grpcio-health-checking and protobuf only).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.duet.v1 import duet_pb2, duet_pb2_grpc
# The client is also a distribution of its own (clients/python/pyproject.toml: no torch, no Ray), which
# ships exactly these imports and the modules they import: keep them pure Python.
from workers.structured.convert import spec_to_proto
from workers.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "localhost:50051"
DEFAULT_MAX_RESUMES = 3
# What a stream ends with when its router (not the request) failed: resume it on another router.
ROUTER_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# Trailing metadata of a stream its draining router handed off (router/server.py): resume it even
# with one target (behind a Service, the next connection reaches another router).
HANDOFF_METADATA_KEY = "duet-handoff"
Targets = str | Sequence[str]
FINISH_REASONS = {duet_pb2.FINISH_REASON_STOP: "stop", duet_pb2.FINISH_REASON_LENGTH: "length",
                  duet_pb2.FINISH_REASON_ABORT: "abort"}


class DuetError(Exception):
    """A request failed: ``code`` is the gRPC status, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> DuetError:
        return cls(e.code(), e.details() or "")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the top alternatives (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One streamed message of choice ``index``: the new text and token ids (and their logprobs when
    asked for); a choice's last chunk also has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, r: duet_pb2.GenerateResponse) -> Chunk:
        final = r.HasField("finish_reason")
        return cls(r.request_id, r.text, tuple(r.token_ids),
                   FINISH_REASONS.get(r.finish_reason, "unspecified") if final else None,
                   Usage(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_prompt_tokens)
                   if final else None, r.index,
                   tuple(TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
                         for lp in r.logprobs))


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """One entry of ListModels: a base model, or a LoRA adapter (``parent`` = its base model)."""

    name: str
    is_default: bool
    max_model_len: int
    parent: str = ""
    source: str = ""


Message = Mapping[str, str] | tuple[str, str]


def build_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                  messages: Iterable[Message] | None = None, model: str = "", request_id: str = "",
                  max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  num_speculative_tokens: int | None = None, n: int = 0, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                  min_p: float | None = None, min_tokens: int = 0, logit_bias: Mapping[int, float] | None = None,
                  top_logprobs: int | None = None,
                  structured: StructuredOutput | None = None) -> duet_pb2.GenerateRequest:
    """The GenerateRequest for these arguments (ValueError if not exactly one prompt form).
    structured: constrain the output (JSON schema, regex, choice, grammar; see
    workers/structured/spec.py), e.g. ``StructuredOutput("choice", choices=("yes", "no"))``."""
    given = [name for name, v in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of prompt, token_ids or messages (got {', '.join(given) or 'none'})")
    sampling = duet_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop), stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos, num_speculative_tokens=num_speculative_tokens, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens,
        logit_bias=dict(logit_bias or {}), top_logprobs=top_logprobs)
    if structured is not None:
        sampling.structured.CopyFrom(spec_to_proto(structured, duet_pb2.StructuredOutput))
    request = duet_pb2.GenerateRequest(sampling=sampling, model=model, request_id=request_id, n=n)
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.prompt_token_ids.ids.extend(token_ids)
    else:
        assert messages is not None
        chat = request.messages
        chat.SetInParent()  # an empty list still selects the messages form (the server rejects it)
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
            chat.messages.add(role=role, content=content)
    return request


def resume_request(request: duet_pb2.GenerateRequest, request_id: str, token_ids: Sequence[int],
                   text_chars: int) -> duet_pb2.GenerateRequest:
    """``request`` again, to continue on another router after ``token_ids`` (and ``text_chars``
    characters of their text) were received; without tokens, the request as it was."""
    again = duet_pb2.GenerateRequest()
    again.CopyFrom(request)
    again.request_id = request.request_id or request_id
    if token_ids:
        again.resume.token_ids.extend(token_ids)
        again.resume.text_chars = text_chars
    return again


class _Resumption:
    """One request's progress across routers: what was received, and whether a failure may move on."""

    def __init__(self, request: duet_pb2.GenerateRequest, targets: Sequence[str], max_resumes: int,
                 timeout: float | None) -> None:
        self.request = request
        self.targets = list(targets)
        self.max_resumes = max_resumes
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.token_ids: list[int] = []
        self.text_chars = 0
        self.request_id = ""
        self.moves = 0

    def received(self, chunk: Chunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text_chars += len(chunk.text)
        self.request_id = self.request_id or chunk.request_id

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def next_request(self, index: int, e: grpc.RpcError) -> duet_pb2.GenerateRequest | None:
        """The request to send to router ``index + 1`` after ``e`` on router ``index``, or None (raise)."""
        code = e.code()
        trailers = e.trailing_metadata() or ()
        handed_off = any(k == HANDOFF_METADATA_KEY for k, _ in trailers)
        if ((len(self.targets) < 2 and not handed_off) or code not in ROUTER_FAILURES or self.moves >= self.max_resumes
                or (self.token_ids and self.request.n > 1) or self.remaining() == 0.0):
            return None
        self.moves += 1
        nxt = self.targets[(index + 1) % len(self.targets)]
        logger.warning("request %s: router %s failed after %d tokens (%s: %s); resuming on %s (%d/%d)",
                       self.request_id or "?", self.targets[index], len(self.token_ids), code.name,
                       e.details(), nxt, self.moves, self.max_resumes)
        return resume_request(self.request, self.request_id, self.token_ids, self.text_chars)


def _targets(target: Targets) -> list[str]:
    targets = [target] if isinstance(target, str) else list(target)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"target={target!r}: give a router's host:port or a list of them")
    return targets


def collect(chunks: Iterable[Chunk]) -> Completion:
    """Join the streamed chunks of a single-choice request into one Completion (ValueError when they
    belong to several choices: use ``collect_choices``)."""
    choices = collect_choices(chunks)
    if len(choices) > 1:
        raise ValueError(f"the chunks hold {len(choices)} choices (n > 1): use collect_choices")
    return choices[0] if choices else Completion("", "", (), None, None)


def collect_choices(chunks: Iterable[Chunk]) -> list[Completion]:
    """Join streamed chunks into one Completion per choice, in index order."""
    by_index: dict[int, list[Chunk]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    out = []
    for index in sorted(by_index):
        cs, last = by_index[index], by_index[index][-1]
        out.append(Completion(last.request_id, "".join(c.text for c in cs), tuple(t for c in cs for t in c.token_ids),
                              last.finish_reason, last.usage, index, tuple(lp for c in cs for lp in c.logprobs)))
    return out


@dataclass(frozen=True)
class ClientTLS:
    """TLS settings for a channel to the router. ca_file: PEM CA bundle to trust (None = the
    system's roots); cert_file + key_file: this client's certificate, for a router that requires
    client certificates (mTLS); server_name: the name to check the router's certificate against
    when it differs from the target's host (e.g. connecting by IP)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("ClientTLS: a client certificate needs both cert_file and key_file")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).expanduser().read_bytes()
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying a bearer token (None when there is no token)."""
    return None if token is None else (("authorization", f"Bearer {token}"),)


DEFAULT_RETRIES = 3


def retry_options(retries: int = DEFAULT_RETRIES, *, initial_backoff_s: float = 0.2,
                  max_backoff_s: float = 5.0) -> list[tuple[str, Any]]:
    """Channel options that make gRPC itself retry duet.v1.Duet calls that fail with
    RESOURCE_EXHAUSTED (admission full) or UNAVAILABLE (no healthy worker, router restarting)
    *before the first response message*, up to ``retries`` times with exponential backoff and
    jitter (gRPC's retry policy, A6: attempt k waits a random time up to
    min(initial * 2^(k-1), max)). A stream that already delivered tokens is never retried: its
    error reaches the caller. gRPC caps attempts at 5 (retries <= 4); 0 = no retries."""
    if not 0 <= retries <= 4:
        raise ValueError(f"retries={retries}: must be in 0..4 (gRPC allows at most 5 attempts)")
    if retries == 0:
        return [("grpc.enable_retries", 0)]
    policy = {"maxAttempts": retries + 1, "initialBackoff": f"{initial_backoff_s}s", "maxBackoff": f"{max_backoff_s}s",
              "backoffMultiplier": 2, "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]}
    config = {"methodConfig": [{"name": [{"service": "duet.v1.Duet"}], "retryPolicy": policy}]}
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def open_channel(target: str, *, tls: ClientTLS | None = None, options: Sequence[tuple[str, Any]] = (),
                 aio: bool = True, retries: int = DEFAULT_RETRIES) -> Any:
    """A grpc(.aio) channel to ``target``: plaintext, or TLS with ``tls``; duet.v1.Duet calls retry
    RESOURCE_EXHAUSTED / UNAVAILABLE before the first token (``retry_options``)."""
    mod = grpc.aio if aio else grpc
    options = retry_options(retries) + list(options)
    if tls is None:
        return mod.insecure_channel(target, options=list(options))
    return mod.secure_channel(target, tls.credentials(), options=list(options) + tls.options())


class DuetClient:
    """Async client; one HTTP/2 channel per router, opened on first use (inside the running event
    loop). target: a router's host:port, or several routers' (a stream whose router fails resumes on
    the next one, up to ``max_resumes`` times: module docstring). tls: connect with TLS (see
    ClientTLS); token: sent as 'authorization: Bearer <token>'; retries: RESOURCE_EXHAUSTED /
    UNAVAILABLE before the first token are retried this many times with backoff on the same router
    (``retry_options``; 0 = off)."""

    def __init__(self, target: Targets = DEFAULT_TARGET, *, options: Sequence[tuple[str, Any]] = (),
                 tls: ClientTLS | None = None, token: str | None = None, retries: int = DEFAULT_RETRIES,
                 max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        self.targets = _targets(target)
        self.target = self.targets[0]
        self.max_resumes = max_resumes
        self._options = list(options)
        self._retries = retries
        retry_options(retries)  # validate now, not on first use
        self._tls = tls
        self._metadata = auth_metadata(token)
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._next = 0  # the router new requests go to first (advanced past one that failed)

    @property
    def _channel(self) -> grpc.aio.Channel | None:
        return self._channels.get(0)

    def _stub(self, index: int = 0) -> duet_pb2_grpc.DuetStub:
        if index not in self._channels:
            self._channels[index] = open_channel(self.targets[index], tls=self._tls, options=self._options,
                                                 retries=self._retries)
        return duet_pb2_grpc.DuetStub(self._channels[index])

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kwargs: Any) -> AsyncIterator[Chunk]:
        """Stream chunks (see the module docstring for the arguments). Closing the iterator cancels
        the request on the server; to stop early, wrap it in ``contextlib.aclosing(...)`` and
        ``break`` (a bare ``break`` cancels only once the generator is garbage-collected)."""
        request = build_request(prompt, **kwargs)
        progress = _Resumption(request, self.targets, self.max_resumes, timeout)
        index = self._next
        while True:
            call = self._stub(index).Generate(request, timeout=progress.remaining(), metadata=self._metadata)
            try:
                async for response in call:
                    chunk = Chunk.from_proto(response)
                    progress.received(chunk)
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                again = progress.next_request(index, e)
                if again is None:
                    raise DuetError.from_rpc(e) from None
                request, index = again, (index + 1) % len(self.targets)
                self._next = index
            finally:
                call.cancel()  # no-op when the call already finished

    async def complete(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        return collect([c async for c in self.generate(prompt, timeout=timeout, **kwargs)])

    async def list_models(self, timeout: float | None = 10.0) -> list[ModelInfo]:
        try:
            r = await self._stub().ListModels(duet_pb2.ListModelsRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise DuetError.from_rpc(e) from None
        return [ModelInfo(m.name, m.is_default, m.max_model_len, m.parent, m.source) for m in r.models]

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """The router's health status name, e.g. "SERVING" or "NOT_SERVING"."""
        self._stub()
        assert self._channel is not None
        try:
            r = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise DuetError.from_rpc(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> DuetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def stream(prompt: str | None = None, *, target: Targets = DEFAULT_TARGET, timeout: float | None = None,
           tls: ClientTLS | None = None, token: str | None = None, retries: int = DEFAULT_RETRIES,
           max_resumes: int = DEFAULT_MAX_RESUMES, **kwargs: Any) -> Iterator[Chunk]:
    """Sync streaming (works inside a running event loop too: it uses the blocking gRPC API).
    Closing the iterator early cancels the request. target: one router or several (a stream whose
    router fails resumes on the next: module docstring)."""
    targets = _targets(target)
    request = build_request(prompt, **kwargs)
    progress = _Resumption(request, targets, max_resumes, timeout)
    index = 0
    while True:
        with open_channel(targets[index], tls=tls, aio=False, retries=retries) as channel:
            call = duet_pb2_grpc.DuetStub(channel).Generate(request, timeout=progress.remaining(),
                                                            metadata=auth_metadata(token))
            try:
                for response in call:
                    chunk = Chunk.from_proto(response)
                    progress.received(chunk)
                    yield chunk
                return
            except grpc.RpcError as e:
                again = progress.next_request(index, e)
                if again is None:
                    raise DuetError.from_rpc(e) from None
                request, index = again, (index + 1) % len(targets)
            finally:
                call.cancel()


def complete(prompt: str | None = None, *, target: Targets = DEFAULT_TARGET, timeout: float | None = None,
             tls: ClientTLS | None = None, token: str | None = None, retries: int = DEFAULT_RETRIES,
             **kwargs: Any) -> Completion:
    """Sync: the whole completion (text, token ids, finish reason, usage)."""
    return collect(stream(prompt, target=target, timeout=timeout, tls=tls, token=token, retries=retries, **kwargs))


def generate_text(prompt: str | None = None, *, target: Targets = DEFAULT_TARGET, timeout: float | None = None,
                  tls: ClientTLS | None = None, token: str | None = None, retries: int = DEFAULT_RETRIES,
                  **kwargs: Any) -> str:
    """Sync: just the completion text."""
    return complete(prompt, target=target, timeout=timeout, tls=tls, token=token, retries=retries, **kwargs).text
