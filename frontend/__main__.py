"""Run the front door: `llm-frontend --triton-grpc 127.0.0.1:8001 --model-dir models/smollm2-135m-instruct`.

It serves the OpenAI API on --host:--port (127.0.0.1:9000; OPENAI_PORT moves the port), sending every
generation to the Triton server's model over gRPC streaming, plus the web page and live batch view
(frontend/batch_view.py) for the first served model.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aiohttp import web

from . import batch_view
from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS, REASONING, Settings, create_app
from .openai_protocol import DEFAULT_MAX_PROMPTS_PER_REQUEST
from .reasoning import PARSERS

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 9000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="llm-frontend", description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton's gRPC endpoint host:port")
    ap.add_argument(
        "--triton-metrics",
        default="http://127.0.0.1:8002/metrics",
        help="Triton's metrics URL, appended to /metrics ('' for none)",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("OPENAI_PORT") or DEFAULT_PORT),
        help=f"port to listen on (default $OPENAI_PORT or {DEFAULT_PORT})",
    )
    ap.add_argument(
        "--model-dir",
        default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"),
        help="the served model's Hugging Face folder (tokenizer and chat template)",
    )
    ap.add_argument(
        "--served-model-name",
        dest="models",
        action="append",
        help="a Triton model to serve under its name (repeat for more; default llm); the first "
        "is shown in the batch view",
    )
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"max_tokens of a request that gives none (default {DEFAULT_MAX_TOKENS})",
    )
    ap.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help=f"completions: most prompts x n in one request; more is a 400 (default {DEFAULT_MAX_PROMPTS_PER_REQUEST})",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("LLM_API_KEY", ""),
        help="require 'Authorization: Bearer <key>' (or 'x-api-key: <key>') on /v1 routes, /tokenize and /detokenize "
        "(default $LLM_API_KEY; prefer the variable: arguments show in the process list)",
    )
    ap.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        default="auto",
        help="split the model's reasoning (<think> ... </think>) from its answer: auto (the default: qwen3 when "
        "the chat template handles <think> tags, else none), qwen3, deepseek_r1 (the answer starts inside the "
        "reasoning) or none",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = Settings(
        args.triton_grpc,
        args.models or ["llm"],
        args.model_dir,
        args.max_body_bytes,
        args.default_max_tokens,
        args.triton_metrics,
        args.max_prompts_per_request,
        args.api_key,
        args.reasoning_parser,
    )

    def add_batch_view(app: web.Application) -> None:
        batch_view.add_routes(app, settings.triton_grpc, settings.models[0])

    app = create_app(settings, extra_routes=[add_batch_view])
    print(
        f"OpenAI API on http://{args.host}:{args.port}/v1 (models {settings.models}; Triton gRPC "
        f"{settings.triton_grpc}; API key {'required' if settings.api_key else 'not required'}; reasoning parser "
        f"{app[REASONING].name})",
        flush=True,
    )
    web.run_app(app, host=args.host, port=args.port, print=None, handler_cancellation=True, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
