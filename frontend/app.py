"""The front door's aiohttp application: OpenAI routes, health, metrics, the body limit, errors as OpenAI JSON.

Routes:
    POST /v1/chat/completions, POST /v1/completions   OpenAI API (whole answers or server-sent events)
    GET  /v1/models, GET /v1/models/{model}            the served model names
    GET  /health                                       200 while the front door runs
    GET  /health/ready                                 200 when Triton reports every served model ready, else 503
    GET|HEAD /metrics                                  the front door's counters, then Triton's metrics
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web

from .completions import answer_stream, answer_whole
from .errors import APIError, bad_request, body_too_large, internal_error, model_not_found
from .metrics import FrontDoorMetrics, metrics_response, triton_metrics
from .openai_protocol import parse_chat, parse_completion
from .openai_responses import ChatFormat, CompletionFormat
from .tokenizer import ModelTokenizer
from .triton_stream import TritonLLM

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_TOKENS = 256
READ_CHUNK_BYTES = 64 << 10


@dataclass
class Settings:
    triton_grpc: str  # host:port of Triton's gRPC endpoint
    models: list[str]  # the Triton models served under their own names; the first is the default
    model_dir: str  # Hugging Face folder with the tokenizer and chat template
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a request gives neither max_tokens nor max_completion_tokens
    triton_metrics_url: str = ""  # e.g. http://127.0.0.1:8002/metrics, appended to /metrics ("" for none)
    started: int = field(default_factory=lambda: int(time.time()))


SETTINGS = web.AppKey("settings", Settings)
LLM = web.AppKey("llm", TritonLLM)
TOKENIZER = web.AppKey("tokenizer", ModelTokenizer)
COUNTERS = web.AppKey("counters", FrontDoorMetrics)
HTTP = web.AppKey("http", aiohttp.ClientSession)


def create_app(settings: Settings, tokenizer: ModelTokenizer | None = None,
               extra_routes: Iterable[Callable[[web.Application], None]] = ()) -> web.Application:
    """The application; `extra_routes` are called with it to add more routes (the batch view's page)."""
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[TOKENIZER] = tokenizer or ModelTokenizer(settings.model_dir)
    app[COUNTERS] = FrontDoorMetrics()
    app.cleanup_ctx.append(_clients)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/health/ready", _ready)
    app.router.add_get("/metrics", _metrics)  # add_get answers HEAD too
    for add in extra_routes:
        add(app)
    return app


async def _clients(app: web.Application):
    """The gRPC channel and HTTP session live in the server's event loop."""
    app[LLM] = TritonLLM(app[SETTINGS].triton_grpc)
    app[HTTP] = aiohttp.ClientSession()
    yield
    await app[LLM].close()
    await app[HTTP].close()


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every error as OpenAI's error JSON; OpenAI routes counted by status."""
    counters = request.app[COUNTERS]
    counted = request.path.startswith("/v1/") and request.method == "POST"
    counters.in_flight += counted
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except APIError as exc:
        status = exc.status
        return exc.response()
    except web.HTTPException as exc:  # unknown route, wrong method, aiohttp's own body limit
        status = exc.status
        if exc.status < 400:
            raise
        return APIError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                        "invalid_request_error" if exc.status < 500 else "internal_server_error").response()
    except (asyncio.CancelledError, ConnectionResetError, aiohttp.ClientConnectionResetError):
        status = 499  # the client went away (its handler is cancelled, or a write found the connection gone)
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must still answer in OpenAI's shape
        request.app.logger.exception("unhandled error on %s", request.path)
        return internal_error(f"internal error: {exc!r}").response()
    finally:
        if counted:
            counters.in_flight -= 1
            counters.requests[(request.path, status)] += 1


async def read_json(request: web.Request, limit: int):
    """The body as JSON, read with a cap: past `limit` bytes the reading stops and the answer is 413."""
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    body = bytearray()
    async for chunk in request.content.iter_chunked(READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def _chat(request: web.Request) -> web.StreamResponse:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body = await read_json(request, settings.max_body_bytes)
    generation = parse_chat(body, settings.models, settings.default_max_tokens, tokenizer.render_chat)
    return await _answer(request, generation, ChatFormat(generation, tokenizer))


async def _completions(request: web.Request) -> web.StreamResponse:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body = await read_json(request, settings.max_body_bytes)
    generation = parse_completion(body, settings.models, settings.default_max_tokens)
    return await _answer(request, generation, CompletionFormat(generation, tokenizer))


async def _answer(request: web.Request, generation, fmt) -> web.StreamResponse:
    llm = request.app[LLM]
    if generation.stream:
        return await answer_stream(request, llm, generation, fmt)
    return await answer_whole(llm, generation, fmt)


def _model_card(settings: Settings, name: str) -> dict:
    return {"id": name, "object": "model", "created": settings.started, "owned_by": "triton"}


async def _models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return web.json_response({"object": "list", "data": [_model_card(settings, m) for m in settings.models]})


async def _model(request: web.Request) -> web.Response:
    settings, name = request.app[SETTINGS], request.match_info["model"]
    if name not in settings.models:
        raise model_not_found(name, settings.models)
    return web.json_response(_model_card(settings, name))


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    llm, models = request.app[LLM], request.app[SETTINGS].models
    ready = {m: await llm.is_model_ready(m) for m in models}
    return web.json_response({"status": "ready" if all(ready.values()) else "not ready", "models": ready},
                             status=200 if all(ready.values()) else 503)


async def _metrics(request: web.Request) -> web.Response:
    url = request.app[SETTINGS].triton_metrics_url
    triton_text = await triton_metrics(request.app[HTTP], url) if url and request.method != "HEAD" else ""
    return metrics_response(request.app[COUNTERS], triton_text)
