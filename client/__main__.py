"""Command-line client: stream a completion from the `llm` model over gRPC or HTTP.

llm-client "The capital of France is" --max-tokens 32 --temperature 0.7 --seed 1 --show-stats
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from client.api import Chunk, Completion, ServerError, generate_http, stream_grpc, stream_http

# CLI option -> sampling key (None values are not sent).
_SAMPLING_OPTIONS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "ignore_eos",
)


def _unescape(text: str) -> str:
    r"""Turn backslash escapes typed on a shell ("\n", "\t") into the characters."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="llm-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("prompt")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--url", help="host:port (default localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--model", default="llm")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", type=_unescape, help="stop string (repeatable; \\n escapes work)")
    p.add_argument("--n", type=int, help="parallel samples of the prompt")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument(
        "--json-params",
        type=json.loads,
        default={},
        help="extra sampling keys as JSON, e.g. '{\"repetition_penalty\": 1.1}'",
    )
    p.add_argument(
        "--flat",
        action="store_true",
        help="send the options as flat input tensors (TensorRT-LLM style) instead of sampling_parameters",
    )
    p.add_argument("--no-stream", dest="stream", action="store_false", help="one response with the whole text")
    p.add_argument(
        "--show-stats",
        action="store_true",
        help="print finish reason, token counts, TTFT, mean ITL and tokens/s to stderr",
    )
    p.add_argument("--request-id", help="gRPC request id")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each response")
    args = p.parse_args(argv)
    if not isinstance(args.json_params, dict):
        p.error("--json-params must be a JSON object")
    if args.url is None:
        args.url = "localhost:8001" if args.protocol == "grpc" else "localhost:8000"
    return args


def request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for the api functions: `sampling` JSON (or flat tensors with --flat) and extras."""
    options = {k: getattr(args, k) for k in _SAMPLING_OPTIONS if getattr(args, k) is not None}
    kwargs: dict[str, Any] = {"model": args.model, "url": args.url, "timeout_s": args.timeout}
    if args.flat:
        kwargs.update(options)
        sampling = dict(args.json_params)
    else:
        sampling = {**options, **args.json_params}
    if sampling:
        kwargs["sampling"] = sampling
    if args.show_stats:
        kwargs.update(return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True)
    if args.request_id and args.protocol == "grpc":
        kwargs["request_id"] = args.request_id
    return kwargs


def chunks(args: argparse.Namespace, kwargs: dict[str, Any]) -> Iterator[Chunk]:
    """The responses for the request, whatever the protocol and stream mode."""
    if args.protocol == "grpc":
        yield from stream_grpc(args.prompt, stream=args.stream, **kwargs)
    elif args.stream:
        yield from stream_http(args.prompt, **kwargs)
    else:
        yield from generate_http(args.prompt, **kwargs).chunks


def print_stats(c: Completion) -> None:
    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"

    rate = c.tokens_per_s
    lines = [
        f"finish_reason: {c.finish_reason}"
        if not c.samples
        else "finish_reason: " + ", ".join(f"[{i}] {s.finish_reason}" for i, s in c.samples.items()),
        f"input tokens: {c.num_input_tokens if c.num_input_tokens is not None else 'n/a'}",
        f"output tokens: {c.num_output_tokens}",
        f"responses: {len(c.chunks)}",
        f"TTFT: {ms(c.ttft_s)}",
        f"mean ITL: {ms(c.mean_itl_s)}",
        f"end-to-end: {ms(c.e2e_s)}",
        f"tokens/s: {'n/a' if rate is None else f'{rate:.1f}'}",
    ]
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kwargs = request_kwargs(args)
    live = not args.n or args.n <= 1  # several samples are printed one after the other at the end
    received: list[Chunk] = []
    started_at = time.perf_counter()
    try:
        for chunk in chunks(args, kwargs):
            received.append(chunk)
            if live and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except ServerError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130
    completion = Completion.from_chunks(received, started_at)
    if live:
        print()
    else:
        for i, sample in (completion.samples or {0: completion}).items():
            print(f"--- sample {i} ---\n{sample.text}")
    if args.show_stats:
        print_stats(completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
