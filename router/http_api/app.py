"""The OpenAI-compatible HTTP API as a FastAPI app over the router's own Pipeline (no second hop).

Endpoints (OpenAI's paths and JSON; errors as router/http_api/errors.py):

    POST /v1/chat/completions   chat (the model's chat template), stream=true -> SSE ending "data: [DONE]"
    POST /v1/completions        raw prompt (text or token ids), streaming or not
    GET  /v1/models             every served model and LoRA adapter (an adapter's ``parent`` is its base
                                model, its ``root`` its source, as vLLM); GET /v1/models/{id} one or 404
    POST /v1/load_lora_adapter  {lora_name, lora_path[, base_model, pinned, preload]}: register an adapter
                                (vLLM's API; router/adapter_admin.py), admin scope
    POST /v1/unload_lora_adapter  {lora_name}: stop routing it and unload it from the workers, admin scope
    GET  /v1/lora_adapters      the registered adapters and the workers holding each, admin scope
    GET  /health                200 while at least one worker is healthy, 503 otherwise (open: no token)
    GET  /metrics               the router's Prometheus metrics, each with a model_name label

``model`` selects a served model or adapter (router/catalog.py: "", "<model>", "<adapter>" or
"<model>:<adapter>"; unknown: 404 model_not_found); each model has its own tokenizer and chat template.
Both completion endpoints take structured-output fields (router/http_api/structured.py); chat also takes
tools (router/http_api/tools.py: the plan; chat_prompt.py: the prompt; tool_output.py: the
``tool_calls`` in responses).

Security is the gRPC API's (router/security.py): with a tokens file every path but /health needs
``Authorization: Bearer <token>``: the /v1 paths the ``generate`` scope, /metrics ``admin`` (as
duet.control.v1.RouterAdmin, which serves the same counters). TLS is the server's
(router/http_api/server.py).

A streamed request's errors before its first token (bad field, unknown model, admission full, no
worker) are ordinary HTTP errors; after it, the stream carries one ``data: {"error": {...}}`` event
and ends with ``data: [DONE]`` (vLLM's convention; the openai SDK raises it as an APIError).

Example (the openai SDK; any OpenAI client works by changing only its base URL)::

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused-without-a-tokens-file")
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                       messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.duet.v1 import duet_pb2
from router.http_api import convert, structured
from router.http_api.chat_prompt import ChatPrompt
from router.http_api.errors import OpenAIError, from_pydantic, from_request_error, invalid
from router.http_api.render import Renderer, TokenText
from router.http_api.schemas import ChatCompletionRequest, CompletionRequest
from router.http_api.tool_output import ToolOutput
from router.http_api.tools import make_plan
from router.http_api.streaming import DONE, ClientGone, EventStreamResponse, sse, until_disconnect
from router.adapter_admin import AdapterAdmin
from router.adapters import AdapterError, RegisteredAdapter
from router.catalog import ModelCard, ModelCatalog
from router.fanout import FanOut
from router.preprocess import RequestError, ServedModel
from router.security import BearerTokenInterceptor

logger = logging.getLogger(__name__)

_STATUS_BY_CODE = {"UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
                   "PERMISSION_DENIED": (403, "permission_error", "insufficient_scope")}


@dataclass(frozen=True)
class HttpContext:
    """What the app serves from (RouterServer's own objects): the pipeline behind the n fan-out,
    the model, auth, health and metrics."""

    generator: FanOut
    model: ServedModel
    auth: BearerTokenInterceptor | None
    is_serving: Callable[[], bool]
    metrics: CollectorRegistry
    max_request_bytes: int
    catalog: ModelCatalog | None = None  # every served model and adapter (None: ``model`` alone)
    adapters: AdapterAdmin | None = None  # the adapter admin endpoints (None: they answer 404)


class _Served:
    """One served model's tokenizer-bound helpers (built once per model, when the app is)."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.token_text = TokenText(model.tokenizer)
        self.chat_prompt = ChatPrompt(model.tokenizer)


def create_app(ctx: HttpContext) -> FastAPI:
    app = FastAPI(title="Duet OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    catalog = ctx.catalog or ModelCatalog.single(ctx.model)
    served = {name: _Served(catalog.model(name)) for name in catalog.names}

    def resolve(requested: str | None) -> tuple[_Served, RegisteredAdapter | None]:
        """The served model (and adapter) a request's ``model`` names; 404 model_not_found if none."""
        try:
            model, adapter = catalog.resolve(requested or "")
        except RequestError as e:
            raise from_request_error(e) from None
        return served[model.name], adapter

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(OpenAIError(e.status_code, message, code="not_found" if e.status_code == 404 else None)
                            .body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:  # a router bug: log it whole
        logger.exception("%s %s: internal router error", request.method, request.url.path)
        return JSONResponse(OpenAIError(500, "internal router error (see the router's log)", type="server_error")
                            .body(), status_code=500)

    def authorize(request: Request, scope: str) -> None:
        if ctx.auth is None:
            return
        denied = ctx.auth.check(request.headers.get("authorization"), scope, request.url.path)
        if denied is not None:
            status, type_, code = _STATUS_BY_CODE[denied[0].name]
            raise OpenAIError(status, denied[1], type=type_, code=code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if ctx.is_serving():
            return JSONResponse({"status": "serving"})
        return JSONResponse(OpenAIError(503, "not serving: no healthy worker (or shutting down)", type="server_error",
                                        code="service_unavailable").body(), status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        authorize(request, "admin")
        return Response(generate_latest(ctx.metrics), media_type=CONTENT_TYPE_LATEST)

    def model_card(card: ModelCard) -> dict[str, Any]:
        # vLLM's shape: a base model's root is itself; an adapter's root is its source, parent its base
        return {"id": card.name, "object": "model", "created": 0, "owned_by": "duet",
                "root": card.source or card.name, "parent": card.parent or None, "max_model_len": card.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request, "generate")
        return JSONResponse({"object": "list", "data": [model_card(c) for c in catalog.cards()]})

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request) -> JSONResponse:
        authorize(request, "generate")
        card = next((c for c in catalog.cards() if c.name == model_id), None)
        if card is None:
            resolve(model_id)  # 404 naming it (or it is "<model>:<adapter>", listed by its name)
            card = next(c for c in catalog.cards() if c.name == model_id.partition(":")[2])
        return JSONResponse(model_card(card))

    def adapter_admin(request: Request) -> AdapterAdmin:
        authorize(request, "admin")
        if ctx.adapters is None:
            raise OpenAIError(404, f"{request.url.path}: this router has no adapter admin", code="not_found")
        return ctx.adapters

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        admin = adapter_admin(request)
        body = await _parse(request, LoadLoraAdapterRequest, ctx.max_request_bytes)
        try:
            adapter = await admin.load(body.lora_name, body.lora_path, body.base_model or "", preload=body.preload,
                                       pinned=body.pinned)
        except AdapterError as e:
            raise _admin_error(e) from None
        return Response(f"Success: LoRA adapter '{adapter.name}' added successfully (base model {adapter.base}).",
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        admin = adapter_admin(request)
        body = await _parse(request, UnloadLoraAdapterRequest, ctx.max_request_bytes)
        try:
            result = await admin.unload(body.lora_name)
        except AdapterError as e:
            raise _admin_error(e) from None
        busy = f"; still running requests on {', '.join(result.busy)} (their LRU evicts it)" if result.busy else ""
        return Response(f"Success: LoRA adapter '{result.adapter.name}' removed successfully{busy}.",
                        media_type="text/plain")

    @app.get("/v1/lora_adapters")
    async def lora_adapters(request: Request) -> JSONResponse:
        admin = adapter_admin(request)
        return JSONResponse({"object": "list", "data": [
            {"id": a.name, "parent": a.base, "root": a.spec.source, "pinned": a.spec.pinned, "origin": a.origin,
             "loaded_on": on} for a, on in admin.list()]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request, "generate")
        body = await _parse(request, ChatCompletionRequest, ctx.max_request_bytes)
        entry, _ = resolve(body.model)
        model, chat_prompt = entry.model, entry.chat_prompt
        rid = uuid.uuid4().hex
        constraint = structured.from_request(body)
        plan = make_plan(body, chat_prompt.fmt, constraint)
        greq = convert.chat_request(body, rid, model.max_model_len, chat_prompt, plan, constraint)
        tools = None
        if plan is not None and plan.parse:
            fmt, max_calls = plan.fmt, plan.max_calls
            tools = lambda: ToolOutput(fmt, max_calls)  # noqa: E731
        renderer = Renderer(chat=True, request_id=rid, model=body.model or model.name, token_text=entry.token_text,
                            logprobs=body.logprobs, tools=tools)
        sent = plan.structured if plan is not None and plan.structured is not None else constraint

        def rename(param: str) -> str:  # the pipeline names what the request became; name what was sent
            if param == "prompt":  # a chat rendered here goes as prompt_token_ids
                return "messages"
            return sent.rename(param) if sent is not None else param
        return await _answer(request, ctx.generator, greq, renderer, body.stream,
                             bool(body.stream_options and body.stream_options.include_usage), rename)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request, "generate")
        body = await _parse(request, CompletionRequest, ctx.max_request_bytes)
        entry, _ = resolve(body.model)
        rid = uuid.uuid4().hex
        constraint = structured.from_request(body)
        greq = convert.completion_request(body, rid, constraint)
        renderer = Renderer(chat=False, request_id=rid, model=body.model or entry.model.name,
                            token_text=entry.token_text, logprobs=body.logprobs is not None)
        return await _answer(request, ctx.generator, greq, renderer, body.stream,
                             bool(body.stream_options and body.stream_options.include_usage),
                             constraint.rename if constraint is not None else None)

    return app


async def _parse(request: Request, schema: type[BaseModel], limit: int) -> Any:
    """The request body validated against ``schema``: 413 past ``limit`` bytes (read no further),
    400 for malformed JSON or a bad field."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise invalid("body", "empty; send a JSON object", code="missing_required_parameter")
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if errors and errors[0].get("type") == "json_invalid":
            raise invalid("body", f"malformed JSON ({errors[0].get('msg')})", code="invalid_json") from None
        raise from_pydantic(errors) from None


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter, plus Duet's base_model, pinned and preload."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    base_model: str | None = None  # the served model it runs on; unset = the default model
    pinned: bool = False  # workers never evict it (LRU)
    preload: bool = True  # load it on the least-loaded worker now, so a bad adapter is refused here


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


# AdapterError's gRPC status -> HTTP status (vLLM answers a bad adapter with 400, an unknown one with 404)
_ADMIN_STATUS = {"NOT_FOUND": 404, "INVALID_ARGUMENT": 400, "ALREADY_EXISTS": 400, "FAILED_PRECONDITION": 400,
                 "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}


def _admin_error(e: AdapterError) -> OpenAIError:
    status = _ADMIN_STATUS.get(e.code.name, 500)
    param = e.message.split(":", 1)[0] if ":" in e.message.split(" ", 1)[0] else None
    return OpenAIError(status, e.message, type="invalid_request_error" if status < 500 else "server_error",
                       param=param, code="lora_not_found" if status == 404 else e.code.name.lower())


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"body: {size} bytes is larger than the limit of {limit} bytes (router.max_request_bytes)",
                       param="body", code="request_too_large")


async def _answer(request: Request, generator: FanOut, greq: duet_pb2.GenerateRequest, renderer: Renderer,
                  stream: bool, include_usage: bool, rename: Callable[[str], str] | None) -> Response:
    generation = generator.generate(greq)
    if not stream:
        try:
            return JSONResponse(await until_disconnect(request.receive, _collect(generation, renderer, rename)))
        except ClientGone:
            logger.info("request %s: the HTTP client disconnected; cancelled", greq.request_id)
            return Response(status_code=499)
    try:  # errors before the first response are plain HTTP errors
        first = await until_disconnect(request.receive, anext(generation))
    except ClientGone:
        await generation.aclose()
        return Response(status_code=499)
    except RequestError as e:
        await generation.aclose()
        raise from_request_error(e, rename) from None
    except StopAsyncIteration:  # the pipeline always ends with a finish; be safe anyway
        first = None
    return EventStreamResponse(_events(generation, first, renderer, include_usage, greq.request_id, rename))


async def _collect(generation: AsyncGenerator[duet_pb2.GenerateResponse, None], renderer: Renderer,
                   rename: Callable[[str], str] | None) -> dict[str, Any]:
    async with aclosing(generation) as responses:
        try:
            async for r in responses:
                renderer.add(r)
        except RequestError as e:
            raise from_request_error(e, rename) from None
    return renderer.response()


async def _events(generation: AsyncGenerator[duet_pb2.GenerateResponse, None], first: duet_pb2.GenerateResponse | None,
                  renderer: Renderer, include_usage: bool, request_id: str,
                  rename: Callable[[str], str] | None) -> AsyncGenerator[bytes, None]:
    started = time.monotonic()
    async with aclosing(generation) as responses:
        try:
            if first is not None:
                chunk = renderer.chunk(first)
                if chunk is not None:
                    yield sse(_with_usage(chunk, include_usage))
            async for r in responses:
                chunk = renderer.chunk(r)
                if chunk is not None:
                    yield sse(_with_usage(chunk, include_usage))
        except RequestError as e:
            logger.info("request %s: stream failed after %.1f s: %s", request_id, time.monotonic() - started, e.message)
            yield sse(from_request_error(e, rename).body())
            yield DONE
            return
        except Exception:  # a router bug: log it whole, tell the client no more than that
            logger.exception("request %s: internal router error mid-stream", request_id)
            yield sse(OpenAIError(500, "internal router error (see the router's log)", type="server_error").body())
            yield DONE
            return
    if include_usage:
        yield sse(renderer.usage_chunk())
    yield DONE


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    if include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last one
    return chunk
