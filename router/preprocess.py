"""Public request -> PreparedRequest: pick the prompt form, tokenize (chat template for messages),
validate every field, resolve the sampling defaults. Everything a bad request can get wrong is
caught here, before admission and routing, as a RequestError whose message names the field.

Terms:
    ServedModel       the model this router serves: name, tokenizer, context limit, vocab size.
    PreparedRequest   a validated request: prompt token ids + resolved worker SamplingParams.
    request id        what the client sees (its own, or one the router assigns); internal id is
                      the unique id the worker sees (equal to the request id when the router
                      assigned it, so logs on both sides line up).

Example::

    model = ServedModel.load(RouterConfig(tokenizer_path=ckpt))
    req = duet_pb2.GenerateRequest(prompt="Hi", sampling=duet_pb2.SamplingParams(top_p=0))
    prepare_request(req, model, config)
    # RequestError(INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1], got 0.0")
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from protos.duet.v1 import duet_pb2
from protos.duet.worker.v1 import worker_pb2
from router.config import AdapterSpec, ModelSpec, RouterConfig, RouterConfigError
from workers.errors import InvalidRequestError
from workers.structured.convert import spec_from_proto, spec_to_proto
from workers.structured.grammar import GrammarCompiler

MAX_REQUEST_ID_LEN = 256
# Sampling limits (the public proto documents them; the worker checks the same ones again).
PENALTY_RANGE = 2.0  # presence / frequency
MAX_REPETITION_PENALTY = 100.0
LOGIT_BIAS_RANGE = 100.0
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
_NO_LIMIT = 10**8  # transformers' model_max_length when a tokenizer declares none is ~1e30


class RequestError(Exception):
    """A request the router answers with ``code`` and ``message`` (which names the field)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


@dataclass(frozen=True)
class ServedModel:
    """grammars: compiles structured-output specs at the edge (cached), so a bad one is refused
    here, naming the field, and never reaches a worker (built from the tokenizer when not given)."""

    name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    grammars: GrammarCompiler | None = None

    def __post_init__(self) -> None:
        if self.grammars is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            object.__setattr__(self, "grammars", GrammarCompiler(self.tokenizer, self.vocab_size,
                                                                 [] if eos is None else [eos]))

    @classmethod
    def load(cls, config: RouterConfig, tokenizer: Any | None = None) -> ServedModel:
        """The default model of ``config``; loads the tokenizer from ``config.tokenizer_path`` unless given."""
        return cls.load_spec(config.served_models[0], tokenizer)

    @classmethod
    def load_spec(cls, spec: ModelSpec, tokenizer: Any | None = None) -> ServedModel:
        """The model of ``spec`` (router.config.ModelSpec); loads its tokenizer unless given."""
        path = Path(spec.tokenizer_path).expanduser()
        if tokenizer is None:
            if not path.is_dir():
                raise RouterConfigError(f"tokenizer_path={spec.tokenizer_path!r} (model {spec.name}): not a "
                                        "directory; pass the model checkpoint directory the workers serve")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            _warm_up(tokenizer)
        return cls(spec.name, tokenizer, _max_model_len(spec.max_model_len, path, tokenizer), len(tokenizer))


def _warm_up(tokenizer: Any) -> None:
    """Compile the chat template and touch the encoder once, at load: the first call compiles the
    jinja template, which would otherwise land on the first request's TTFT."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
        tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


def _max_model_len(configured: int | None, path: Path, tokenizer: Any) -> int:
    if configured is not None:
        return configured
    try:
        value = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        value = None
    if isinstance(value, int) and value >= 2:
        return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 2 <= value < _NO_LIMIT:
        return value
    raise RouterConfigError(f"max_model_len: not set and not found in {path}/config.json (max_position_embeddings) "
                            "or the tokenizer; set RouterConfig.max_model_len to the workers' context limit")


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    internal_id: str
    prompt_token_ids: list[int]
    sampling: worker_pb2.SamplingParams
    stop: tuple[str, ...]
    # GenerateRequest.resume: tokens (and text, in code points) the client already received
    resume_token_ids: tuple[int, ...] = ()
    resume_text_chars: int = 0
    # The served model it runs on ("" = the router's default) and its LoRA adapter (None = the base model)
    model: str = ""
    adapter: AdapterSpec | None = None

    def submit_request(self) -> worker_pb2.SubmitRequest:
        return worker_pb2.SubmitRequest(request_id=self.internal_id, prompt_token_ids=self.prompt_token_ids,
                                        sampling=self.sampling, adapter=self.adapter_ref)

    @property
    def adapter_ref(self) -> worker_pb2.AdapterRef | None:
        """What SubmitRequest.adapter carries (None: the base model)."""
        return None if self.adapter is None else worker_pb2.AdapterRef(name=self.adapter.name,
                                                                        source=self.adapter.source)

    @property
    def adapter_name(self) -> str:
        return "" if self.adapter is None else self.adapter.name

    @property
    def speculative(self) -> bool:
        """Whether the request may speculate (it did not opt out with num_speculative_tokens 0)."""
        return not self.sampling.HasField("num_speculative_tokens") or self.sampling.num_speculative_tokens > 0


def check_model(request: duet_pb2.GenerateRequest, model: ServedModel) -> None:
    if request.model and request.model != model.name:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"model: unknown model {request.model!r}; this router serves {model.name!r} "
                           "(or leave model empty for the default)")


def prepare_request(request: duet_pb2.GenerateRequest, model: ServedModel, config: RouterConfig, *,
                    adapter: AdapterSpec | None = None) -> PreparedRequest:
    """Validate and tokenize ``request`` for ``model`` (and ``adapter``, as router/catalog.py resolved
    its ``model`` field); raises RequestError naming the first bad field."""
    if adapter is None:
        check_model(request, model)
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise invalid("request_id", f"at most {MAX_REQUEST_ID_LEN} characters, got {len(request.request_id)}")
    field, ids = _prompt_ids(request, model)
    if len(ids) >= model.max_model_len:
        raise invalid(field, f"the prompt is {len(ids)} tokens; the limit is {model.max_model_len - 1} "
                             f"(context {model.max_model_len} = prompt + at least 1 generated token)")
    sampling, stop = _sampling(request.sampling, model, config, len(ids))
    internal_id = uuid.uuid4().hex
    resumed = _resume_ids(request, model, sampling, len(ids))
    return PreparedRequest(request.request_id or internal_id, internal_id, ids, sampling, stop,
                           resumed, request.resume.text_chars if resumed else 0, model.name, adapter)


def _resume_ids(request: duet_pb2.GenerateRequest, model: ServedModel, sampling: worker_pb2.SamplingParams,
                num_prompt: int) -> tuple[int, ...]:
    """GenerateRequest.resume's token ids, checked against the request they continue."""
    if not request.HasField("resume"):
        return ()
    ids = list(request.resume.token_ids)
    if not ids:
        raise invalid("resume.token_ids", "must hold the token ids already received (at least one)")
    if request.n > 1:
        raise invalid("resume", "a request with n > 1 cannot be resumed; resend it whole")
    _check_vocab("resume.token_ids", ids, model.vocab_size)
    if len(ids) >= sampling.max_tokens:
        raise invalid("resume.token_ids", f"{len(ids)} tokens received: nothing is left of max_tokens "
                                          f"{sampling.max_tokens}")
    if num_prompt + len(ids) >= model.max_model_len:
        raise invalid("resume.token_ids", f"prompt {num_prompt} + {len(ids)} received tokens reach the context "
                                          f"limit {model.max_model_len}")
    return tuple(ids)


def _prompt_ids(request: duet_pb2.GenerateRequest, model: ServedModel) -> tuple[str, list[int]]:
    kind = request.WhichOneof("input")
    tok = model.tokenizer
    if kind is None:
        raise invalid("prompt", "no input: set exactly one of prompt, prompt_token_ids or messages")
    if kind == "prompt":
        if not request.prompt:
            raise invalid("prompt", "must be a non-empty string")
        ids = list(tok.encode(request.prompt))  # special tokens as the engine adds them
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        if not ids:
            raise invalid("prompt_token_ids", "must hold at least one token id")
        _check_vocab("prompt_token_ids", ids, model.vocab_size)
    else:
        ids = _chat_ids(request.messages.messages, tok)
    if not ids:
        raise invalid(kind, "tokenizes to zero tokens")
    return kind, ids


def _chat_ids(messages: Any, tok: Any) -> list[int]:
    if not messages:
        raise invalid("messages", "must hold at least one message")
    for i, msg in enumerate(messages):
        if not msg.role:
            raise invalid(f"messages[{i}].role", "must be non-empty (e.g. 'system', 'user', 'assistant')")
    if not getattr(tok, "chat_template", None):
        raise invalid("messages", "this model's tokenizer has no chat template; send a prompt instead")
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja2 raise_exception() in a template: the conversation is malformed
        raise invalid("messages", f"the chat template rejected the conversation: {e}") from None
    # The template already wrote any BOS/special tokens as text, so add none here.
    return list(tok.encode(text, add_special_tokens=False))


def _check_vocab(field: str, ids: list[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise invalid(f"{field}[{i}]", f"token id {t} is outside the vocabulary (size {vocab_size})")


def _sampling(p: duet_pb2.SamplingParams, model: ServedModel, config: RouterConfig,
              prompt_len: int) -> tuple[worker_pb2.SamplingParams, tuple[str, ...]]:
    max_tokens = p.max_tokens if p.HasField("max_tokens") else config.default_max_tokens
    if max_tokens < 1:
        raise invalid("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    temperature = p.temperature if p.HasField("temperature") else config.default_temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid("sampling.temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature}")
    top_p = p.top_p if p.HasField("top_p") else config.default_top_p
    if not 0 < top_p <= 1:  # also rejects NaN
        raise invalid("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if p.HasField("seed") and p.seed >= 2**63:
        raise invalid("sampling.seed", f"must be < 2**63, got {p.seed}")
    if len(p.stop) > config.max_stop_strings:
        raise invalid("sampling.stop", f"at most {config.max_stop_strings} stop strings, got {len(p.stop)}")
    for i, s in enumerate(p.stop):
        if not 0 < len(s) <= config.max_stop_string_len:
            raise invalid(f"sampling.stop[{i}]", f"each stop string must be 1..{config.max_stop_string_len} "
                                                 f"characters, got {len(s)}")
    _check_vocab("sampling.stop_token_ids", list(p.stop_token_ids), model.vocab_size)
    if p.HasField("num_speculative_tokens") and p.num_speculative_tokens > 64:
        raise invalid("sampling.num_speculative_tokens", f"must be in 0..64 (0 = off), got {p.num_speculative_tokens}")
    extra = _penalties(p, model, max_tokens)
    if p.HasField("structured"):
        extra["structured"] = _structured(p, model)
    # Past the context limit the worker ends with LENGTH anyway; clamping keeps load estimates honest.
    max_tokens = min(max_tokens, model.max_model_len - prompt_len)
    extra["min_tokens"] = min(extra["min_tokens"], max_tokens)
    sampling = worker_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        num_speculative_tokens=p.num_speculative_tokens if p.HasField("num_speculative_tokens") else None, **extra)
    return sampling, tuple(p.stop)


def _structured(p: duet_pb2.SamplingParams, model: ServedModel) -> worker_pb2.StructuredOutput:
    """Validate and compile the structured-output spec (cached; bounded by the compiler's time limit).
    Blocking: the pipeline prepares such requests off the event loop."""
    try:
        spec = spec_from_proto(p.structured)
        if spec is not None:
            if p.ignore_eos:
                raise InvalidRequestError("ignore_eos", "cannot be combined with structured output (EOS ends "
                                                        "the output where the grammar is complete)")
            assert model.grammars is not None  # set in ServedModel.__post_init__
            model.grammars.compile(spec)
    except InvalidRequestError as e:
        raise invalid(f"sampling.{e.field}", str(e)[len(e.field) + 2:]) from None
    return spec_to_proto(spec, worker_pb2.StructuredOutput)


def _penalties(p: duet_pb2.SamplingParams, model: ServedModel, max_tokens: int) -> dict[str, Any]:
    """Validate and resolve the penalty, min-p, min_tokens, logit_bias and logprobs fields."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name) if p.HasField(name) else 0.0
        if not -PENALTY_RANGE <= value <= PENALTY_RANGE:  # also rejects NaN
            raise invalid(f"sampling.{name}", f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off), "
                                              f"got {value}")
        out[name] = value
    rep = p.repetition_penalty if p.HasField("repetition_penalty") else 1.0
    if not 0 < rep <= MAX_REPETITION_PENALTY:
        raise invalid("sampling.repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {rep}")
    out["repetition_penalty"] = rep
    min_p = p.min_p if p.HasField("min_p") else 0.0
    if not 0 <= min_p <= 1:
        raise invalid("sampling.min_p", f"must be in [0, 1] (0 = off), got {min_p}")
    out["min_p"] = min_p
    if p.min_tokens > max_tokens:
        raise invalid("sampling.min_tokens", f"must be <= max_tokens ({max_tokens}), got {p.min_tokens}")
    out["min_tokens"] = p.min_tokens
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(p.logit_bias)}")
    for token, bias in sorted(p.logit_bias.items()):
        if token >= model.vocab_size:
            raise invalid("sampling.logit_bias", f"token id {token} is outside the vocabulary (size {model.vocab_size})")
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise invalid(f"sampling.logit_bias[{token}]", f"must be in [-{LOGIT_BIAS_RANGE:g}, "
                                                           f"{LOGIT_BIAS_RANGE:g}], got {bias}")
    out["logit_bias"] = dict(p.logit_bias)
    if p.HasField("top_logprobs"):
        if p.top_logprobs > MAX_TOP_LOGPROBS:
            raise invalid("sampling.top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS} (unset = no logprobs), "
                                                   f"got {p.top_logprobs}")
        out["top_logprobs"] = p.top_logprobs
    return out
