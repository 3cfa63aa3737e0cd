"""The front door's aiohttp application: OpenAI and Anthropic routes, health, metrics, the body limit, errors as
OpenAI's JSON (Anthropic's on its routes).

Routes:
    POST /v1/chat/completions, POST /v1/completions   OpenAI API (whole answers or server-sent events)
    GET  /v1/models, GET /v1/models/{model}            the served model names and their max_model_len, and their
                                                       LoRA adapters (`parent`: the model each adapts)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter  LoRA adapters added and removed while serving (lora.py)
    POST /v1/responses                                 OpenAI's Responses API, stateless (responses_api.py)
    POST /v1/messages, POST /v1/messages/count_tokens  Anthropic's Messages API (anthropic_messages.py), its errors
                                                       in Anthropic's shape (anthropic_errors.py)
    POST /tokenize, POST /detokenize                   the model's tokenizer (vLLM's routes)
    GET  /health                                       200 while the front door runs
    GET  /health/ready                                 200 when Triton reports every served model ready, else 503
    GET|HEAD /metrics                                  the front door's counters, then Triton's metrics
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from tritonclient.utils import InferenceServerException

from .admission import Admission
from .anthropic_errors import error_response, is_anthropic_route
from .anthropic_messages import parse_count_tokens, parse_messages
from .anthropic_stream import answer_messages
from .auth import api_key_middleware
from .completions import answer_stream, answer_whole
from .errors import APIError, bad_request, internal_error, model_not_found
from .generation import Generation, is_constrained
from .lora import AdapterIndex, load_adapter, unload_adapter
from .metrics import FrontDoorMetrics, metrics_response, triton_metrics
from .openai_protocol import DEFAULT_MAX_PROMPTS_PER_REQUEST, parse_chat, parse_completion
from .openai_responses import ChatFormat, CompletionFormat
from .reasoning import Reasoning, ReasoningParser
from .request_body import read_json
from .responses_api import parse_responses
from .responses_output import answer_responses
from .tokenization import detokenize, tokenize
from .tokenizer import ModelTokenizer
from .triton_stream import TritonLLM

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_TOKENS = 256


@dataclass
class Settings:
    triton_grpc: str  # host:port of Triton's gRPC endpoint
    models: list[str]  # the Triton models served under their own names; the first is the default
    model_dir: str  # Hugging Face folder with the tokenizer and chat template
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a request gives neither max_tokens nor max_completion_tokens
    triton_metrics_url: str = ""  # e.g. http://127.0.0.1:8002/metrics, appended to /metrics ("" for none)
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # completions: prompts x n per request
    api_key: str = field(default="", repr=False)  # "": no key needed (bind to loopback only); never printed
    reasoning_parser: str = "auto"  # auto, qwen3, deepseek_r1 or none (frontend/reasoning.py)
    started: int = field(default_factory=lambda: int(time.time()))


SETTINGS = web.AppKey("settings", Settings)
LLM = web.AppKey("llm", TritonLLM)
TOKENIZER = web.AppKey("tokenizer", ModelTokenizer)
COUNTERS = web.AppKey("counters", FrontDoorMetrics)
HTTP = web.AppKey("http", aiohttp.ClientSession)
ADMISSION = web.AppKey("admission", Admission)
ADAPTERS = web.AppKey("adapters", AdapterIndex)
REASONING = web.AppKey("reasoning", ReasoningParser)


def create_app(
    settings: Settings,
    tokenizer: ModelTokenizer | None = None,
    extra_routes: Iterable[Callable[[web.Application], None]] = (),
) -> web.Application:
    """The application; `extra_routes` are called with it to add more routes (the batch view's page)."""
    middlewares = [_errors] + ([api_key_middleware(settings.api_key)] if settings.api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[TOKENIZER] = tokenizer or ModelTokenizer(settings.model_dir)
    app[REASONING] = ReasoningParser(
        settings.reasoning_parser,
        getattr(app[TOKENIZER], "chat_template", None),
        getattr(app[TOKENIZER], "decode", None),
    )
    app[COUNTERS] = FrontDoorMetrics()
    app.cleanup_ctx.append(_clients)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_post("/v1/messages", _messages)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/v1/load_lora_adapter", _load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", _unload_adapter)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/health/ready", _ready)
    app.router.add_get("/metrics", _metrics)  # add_get answers HEAD too
    for add in extra_routes:
        add(app)
    return app


async def _clients(app: web.Application):
    """The gRPC channel and HTTP session live in the server's event loop."""
    app[LLM] = TritonLLM(app[SETTINGS].triton_grpc)
    app[ADMISSION] = Admission(app[LLM])
    app[ADAPTERS] = AdapterIndex(app[LLM], app[SETTINGS].models)
    app[HTTP] = aiohttp.ClientSession()
    yield
    await app[LLM].close()
    await app[HTTP].close()


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every error as OpenAI's error JSON (Anthropic's on its routes); API routes counted by status."""
    counters = request.app[COUNTERS]
    respond = error_response if is_anthropic_route(request.path) else APIError.response
    counted = request.path.startswith("/v1/") and request.method == "POST"
    counters.in_flight += counted
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except APIError as exc:
        response = respond(exc)
        status = response.status
        return response
    except web.HTTPException as exc:  # unknown route, wrong method, aiohttp's own body limit
        status = exc.status
        if exc.status < 400:
            raise
        return respond(
            APIError(
                exc.status,
                f"{exc.reason}: {request.method} {request.path}",
                "invalid_request_error" if exc.status < 500 else "internal_server_error",
            )
        )
    except (asyncio.CancelledError, ConnectionResetError, aiohttp.ClientConnectionResetError):
        status = 499  # the client went away (its handler is cancelled, or a write found the connection gone)
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must still answer in OpenAI's shape
        request.app.logger.exception("unhandled error on %s", request.path)
        return respond(internal_error(f"internal error: {exc!r}"))
    finally:
        if counted:
            counters.in_flight -= 1
            counters.requests[(request.path, status)] += 1


async def _body_and_served(request: web.Request) -> tuple[object, list[str]]:
    """The request's JSON body and the model names it may ask for (the served models and their adapters)."""
    body = await read_json(request, request.app[SETTINGS].max_body_bytes)
    return body, await request.app[ADAPTERS].served(body.get("model") if isinstance(body, dict) else None)


async def _chat(request: web.Request) -> web.StreamResponse:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body, served = await _body_and_served(request)
    generation = parse_chat(body, served, settings.default_max_tokens, tokenizer.render_chat)
    generation.reasoning = _reasoning(request.app, generation)
    return await _answer(request, generation, ChatFormat(generation, tokenizer))


async def _completions(request: web.Request) -> web.StreamResponse:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body, served = await _body_and_served(request)
    generation = parse_completion(
        body, served, settings.default_max_tokens, tokenizer.vocab_size, settings.max_prompts_per_request
    )
    return await _answer(request, generation, CompletionFormat(generation, tokenizer))


async def _responses(request: web.Request) -> web.StreamResponse:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body, served = await _body_and_served(request)
    parsed = parse_responses(body, served, settings.default_max_tokens, tokenizer.render_chat)
    parsed.generation.reasoning = _reasoning(request.app, parsed.generation)
    request.app[ADAPTERS].route(parsed.generation)
    return await answer_responses(request, request.app[LLM], parsed, request.app[ADMISSION])


async def _messages(request: web.Request) -> web.StreamResponse:
    tokenizer = request.app[TOKENIZER]
    body, served = await _body_and_served(request)
    parsed = parse_messages(body, served, tokenizer.render_chat)
    if parsed.thinking:
        if is_constrained(parsed.generation):
            raise bad_request(
                'thinking {"type": "enabled"} cannot be used when tool_choice forces tool use', "thinking"
            )
        parsed.generation.reasoning = _reasoning(request.app, parsed.generation)
        if parsed.generation.reasoning is None:
            raise bad_request(
                'thinking {"type": "enabled"} needs a reasoning model: this front door reads no reasoning from '
                "this model's answers (its --reasoning-parser is none, or the chat template has no <think> tags)",
                "thinking",
            )
    request.app[ADAPTERS].route(parsed.generation)
    return await answer_messages(request, request.app[LLM], parsed, request.app[ADMISSION])


def _reasoning(app: web.Application, generation: Generation) -> Reasoning | None:
    """The request's reasoning parser; none for a constrained answer (structured output, a forced tool call):
    the grammar holds from the first token, so all of it is the answer."""
    return None if is_constrained(generation) else app[REASONING].for_prompt(generation.prompts[0])


async def _count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as the engine counts them (it tokenizes a text prompt with its special tokens)."""
    tokenizer = request.app[TOKENIZER]
    body, served = await _body_and_served(request)
    prompt = parse_count_tokens(body, served, tokenizer.render_chat)
    return web.json_response({"input_tokens": len(tokenizer.encode(prompt))})


async def _answer(request: web.Request, generation, fmt) -> web.StreamResponse:
    llm, admission = request.app[LLM], request.app[ADMISSION]
    request.app[ADAPTERS].route(generation)
    if generation.stream:
        return await answer_stream(request, llm, generation, fmt, admission)
    return await answer_whole(llm, generation, fmt, admission)


async def _tokenize(request: web.Request) -> web.Response:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body = await read_json(request, settings.max_body_bytes)
    model, answer = tokenize(body, settings.models, tokenizer, tokenizer.render_chat)
    return web.json_response({**answer, "max_model_len": await _max_model_len(request.app, model)})


async def _detokenize(request: web.Request) -> web.Response:
    settings, tokenizer = request.app[SETTINGS], request.app[TOKENIZER]
    body = await read_json(request, settings.max_body_bytes)
    return web.json_response(detokenize(body, settings.models, tokenizer))


async def _max_model_len(app: web.Application, model: str) -> int | None:
    """The model's length limit: its max_model_len setting where set, within what the model supports."""
    supported = app[TOKENIZER].max_position_embeddings
    try:
        setting = int((await app[LLM].model_parameters(model)).get("max_model_len") or 0)
    except (InferenceServerException, ValueError):
        setting = 0
    return min(setting, supported) if setting and supported else setting or supported


async def _model_card(app: web.Application, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": app[SETTINGS].started,
        "owned_by": "triton",
        "max_model_len": await _max_model_len(app, name),
    }


async def _load_adapter(request: web.Request) -> web.Response:
    return await load_adapter(request, request.app[ADAPTERS])


async def _unload_adapter(request: web.Request) -> web.Response:
    return await unload_adapter(request, request.app[ADAPTERS])


async def _adapter_card(app: web.Application, name: str) -> dict:
    """An adapter as vLLM lists one: its folder as `root`, the model it adapts as `parent`."""
    parent, path = app[ADAPTERS].adapters[name]
    return {**await _model_card(app, parent), "id": name, "root": path, "parent": parent}


async def _models(request: web.Request) -> web.Response:
    app = request.app
    await app[ADAPTERS].refresh()
    cards = [await _model_card(app, m) for m in app[SETTINGS].models]
    cards += [await _adapter_card(app, name) for name in app[ADAPTERS].adapters]
    return web.json_response({"object": "list", "data": cards})


async def _model(request: web.Request) -> web.Response:
    settings, name = request.app[SETTINGS], request.match_info["model"]
    served = await request.app[ADAPTERS].served(name)
    if name not in served:
        raise model_not_found(name, served)
    if name in settings.models:
        return web.json_response(await _model_card(request.app, name))
    return web.json_response(await _adapter_card(request.app, name))


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    llm, models = request.app[LLM], request.app[SETTINGS].models
    ready = {m: await llm.is_model_ready(m) for m in models}
    return web.json_response(
        {"status": "ready" if all(ready.values()) else "not ready", "models": ready},
        status=200 if all(ready.values()) else 503,
    )


async def _metrics(request: web.Request) -> web.Response:
    url = request.app[SETTINGS].triton_metrics_url
    triton_text = await triton_metrics(request.app[HTTP], url) if url and request.method != "HEAD" else ""
    return metrics_response(request.app[COUNTERS], triton_text)
