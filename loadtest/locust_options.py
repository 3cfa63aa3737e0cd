"""The load test's options on Locust's command line and in its web UI form (--grpc-url, --prompts-file,
--max-tokens-dist, ...); loadtest/locustfile.py imports this module, which registers the Locust listener that adds
them."""

from __future__ import annotations

from locust import events


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    group = parser.add_argument_group("LLM load test (loadtest/locustfile.py)")
    group.add_argument(
        "--grpc-url", default="", help="gRPC endpoint host:port for GrpcStreamUser (default: --host's host, port 8001)"
    )
    group.add_argument(
        "--openai-url",
        default="",
        help="the OpenAI-compatible front door for OpenAIChatUser (default: --host's host, port 9000)",
    )
    group.add_argument("--model", default="llm", help="model name on the server (default llm)")
    group.add_argument(
        "--trtllm-model",
        default="tensorrt_llm_bls",
        help="the non-decoupled TensorRT-LLM model TrtllmInferUser calls (default tensorrt_llm_bls)",
    )
    group.add_argument(
        "--prompts-file",
        default="",
        help="prompts: .txt (one per line), .jsonl or .json (records with prompt and optional "
        "max_tokens); default: the built-in synthetic set",
    )
    group.add_argument(
        "--input-words",
        default="",
        help="instead of the built-in set, synthetic prompts whose word counts follow this "
        "distribution (same specs as --max-tokens-dist, e.g. normal:200,50)",
    )
    group.add_argument(
        "--max-tokens-dist",
        default="uniform",
        help="output-length distribution: uniform | fixed:N | normal:MEAN,STD | "
        "lognormal:MEDIAN,SIGMA | exponential:MEAN | choice:A,B,C (clamped to min/max)",
    )
    group.add_argument(
        "--max-tokens-min", type=int, default=0, help="smallest max_tokens (default 16 for uniform, else 1)"
    )
    group.add_argument(
        "--max-tokens-max", type=int, default=0, help="largest max_tokens (default 128 for uniform, else 4096)"
    )
    group.add_argument(
        "--ignore-file-max-tokens",
        action="store_true",
        default=False,
        help="draw max_tokens from the distribution even where the prompts file gives one",
    )
    group.add_argument(
        "--ignore-eos",
        default="true",
        choices=["true", "false"],
        help="send ignore_eos so each request generates exactly max_tokens (default true)",
    )
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    group.add_argument(
        "--wait-time",
        type=float,
        default=0.0,
        help="think time between a user's requests: uniform in [0, this] seconds (default 0)",
    )
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    group.add_argument(
        "--failure-backoff",
        type=float,
        default=0.1,
        help="seconds a user waits after a failed request, so that refusals do not turn into a busy loop (default 0.1)",
    )
    group.add_argument(
        "--throughput-interval",
        type=float,
        default=5.0,
        help="seconds between THROUGHPUT rows (output tokens/s, requests/s); 0: none",
    )
    group.add_argument(
        "--workload-seed",
        type=int,
        default=0,
        help="seed of the prompt and length draws (0: a different draw each run)",
    )
