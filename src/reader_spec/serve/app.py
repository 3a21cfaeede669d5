"""The OpenAI-compatible HTTP API over an :class:`EngineService`.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models``, ``/health`` and ``/metrics``. Every error is an OpenAI error object with a 4xx or 5xx
status and no stack trace; a prompt is checked (template, vocabulary, context length) before it is
queued, so that a bad request costs the engine nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from reader_spec.config import GenerationConfig
from reader_spec.prompts import PromptError
from reader_spec.serve.metrics import Metrics
from reader_spec.serve.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    choice_configs,
)
from reader_spec.serve.replies import Choice, Reply
from reader_spec.serve.service import EngineService, QueueFull, ShuttingDown, Stream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_grace_seconds: float = 10.0
    """How long running requests may go on once shutdown begins; then they are cancelled."""


def create_app(service: EngineService, settings: ServerSettings) -> FastAPI:
    """The ASGI app; it starts the engine thread on start-up and stops it gracefully on shutdown."""
    metrics = Metrics(service.engine.scheduler.num_rows)
    service.on_step = metrics.record_step
    tokenizer = service.engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        await asyncio.to_thread(service.stop, settings.shutdown_grace_seconds)

    app = FastAPI(title="reader-spec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service, app.state.metrics = service, metrics

    # --- cross-cutting: auth, body size, errors, request counts ----------------------------------
    app.add_middleware(_Guard, settings=settings, metrics=metrics)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        location = [str(part) for part in first.get("loc", ())[1:2]]  # the body's field, not its type
        if first.get("type") == "json_invalid":
            return _error(OpenAIError(400, "the body is not valid JSON"))
        param = ".".join(location) or None
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return _error(OpenAIError(400, f"{param or 'body'}: {message}", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return _error(OpenAIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return _error(OpenAIError(500, "internal server error"))

    # --- endpoints ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not service.alive:  # requests would be refused: a load balancer should stop sending them
            return _error(OpenAIError(503, "the engine thread has stopped; restart the server"))
        return {
            "status": "ok",
            "running": len(service.engine.scheduler.running),
            "in_flight": service.in_flight,
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        model = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "reader-spec"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, settings)
        body.check_supported()
        prompts = body.prompts()
        encoded = [_encode(service, prompt, "prompt") for prompt in prompts]
        requested = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        configs = [
            _checked(service, body.generation_config(_max_new_tokens(service, tokens, requested)))
            for tokens in encoded
        ]
        echoes = None
        if body.echo:  # the prompt as given; token ids as their text
            echoes = [
                p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True) for p in prompts
            ]
        return await respond(body, request, encoded, configs, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, settings)
        body.check_supported()
        messages = [m.model_dump() for m in body.messages]
        tokens = _encode(service, messages, "messages")
        limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limited = _max_new_tokens(service, tokens, body.requested_tokens(), limit)
        config = _checked(service, body.generation_config(limited))
        return await respond(body, request, [tokens], [config], chat=True)

    async def respond(body, request: Request, prompts, configs, chat: bool, echoes=None):
        """Queue the choices of every prompt (``n`` each, in order), then stream the reply or wait
        for the whole of it."""
        jobs = [
            (p, tokens, choice)
            for p, (tokens, config) in enumerate(zip(prompts, configs, strict=True))
            for choice in choice_configs(config, body.n)
        ]
        streams = _submit(service, [(tokens, config) for _, tokens, config in jobs])
        choices = [
            Choice(index, stream, service, tokenizer, config, tokens, echoes[p] if echoes else None)
            for index, (stream, (p, tokens, config)) in enumerate(zip(streams, jobs, strict=True))
        ]
        prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        reply = Reply(prefix, kind, settings.model_name, choices, body.n)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(reply.stream(chat, include_usage))
        return await reply.whole(request, chat=chat)

    return app


# --- request checks -----------------------------------------------------------------------------------
def _check_model(name: str, settings: ServerSettings) -> None:
    if name != settings.model_name:
        raise OpenAIError(
            404,
            f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
            "model",
            code="model_not_found",
        )


def _encode(service: EngineService, prompt, param: str) -> list[int]:
    try:
        return service.engine.encode(prompt)
    except PromptError as e:
        raise OpenAIError(400, str(e), param) from None


def _checked(service: EngineService, config):
    """The settings, once the model can honour them (a logit bias names tokens of its vocabulary)."""
    try:
        service.engine.check_config(config)
    except ValueError as e:
        raise OpenAIError(400, str(e), "logit_bias") from None
    return config


def _max_new_tokens(
    service: EngineService, tokens: list[int], requested: int | None, param: str = "max_tokens"
) -> int:
    """The request's limit (the body's field ``param``), or all the room the context leaves; a limit past
    the context is refused."""
    room = service.engine.max_context - len(tokens) if service.engine.max_context else None
    if requested is None:
        return room if room is not None else DEFAULT_COMPLETION_TOKENS
    if requested < 1:
        raise OpenAIError(400, f"{param} must be at least 1, got {requested}", param)
    if room is not None and requested > room:
        raise OpenAIError(
            400,
            f"{param} is {requested:,} but the prompt's {len(tokens):,} tokens leave {room:,} of the "
            f"model's {service.engine.max_context:,}",
            param,
        )
    return requested


def _submit(service: EngineService, jobs: list[tuple[list[int], GenerationConfig]]) -> list[Stream]:
    """One engine request per choice (its prompt's tokens and its settings); all of them or none."""
    streams: list[Stream] = []
    try:
        for tokens, config in jobs:
            streams.append(service.submit(tokens, config))
    except (QueueFull, ShuttingDown) as error:
        for stream in streams:
            service.cancel(stream.key)
        if isinstance(error, QueueFull):
            raise OpenAIError(
                429, "the server is at capacity; retry shortly", kind="rate_limit_error"
            ) from None
        raise OpenAIError(503, str(error)) from None
    return streams


def _error(error: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except OpenAIError as error:  # after the headers went out: the error travels as an event
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _BodyTooLarge(OpenAIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the body is over {limit:,} bytes")


class _Guard:
    """Pure ASGI middleware: the API key, the body size limit, and a count of responses by status."""

    def __init__(self, app, settings: ServerSettings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers, limit = scope["path"], dict(scope["headers"]), self.settings.max_body_bytes
        counted = path.startswith("/v1/")

        async def counting_send(message):
            if counted and message["type"] == "http.response.start":
                self.metrics.requests.labels(status=str(message["status"])).inc()
            await send(message)

        key = self.settings.api_key
        if (
            key is not None
            and path != "/health"
            # in constant time: how long a wrong key takes to refuse must not tell how much of it was right
            and not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode())
        ):
            error = OpenAIError(401, "missing or wrong API key", kind="authentication_error")
            return await _error(error)(scope, receive, counting_send)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            return await _error(_BodyTooLarge(limit))(scope, receive, counting_send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # FastAPI re-raises an HTTPException from reading the body, not others
                raise StarletteHTTPException(413, _BodyTooLarge(limit).message)
            return message

        await self.app(scope, limited_receive, counting_send)
