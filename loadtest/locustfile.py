"""Locust load test for the `llm` model, calling the live server the way real clients do.

Four user types (equal weights; pick some by naming them after the options, e.g. `... GrpcStreamUser`):

    GrpcStreamUser     gRPC bi-directional streaming (tritonclient, via client/api.py GrpcStream)
    HttpStreamUser     POST /v2/models/<model>/generate_stream (server-sent events)
    HttpGenerateUser   POST /v2/models/<model>/generate (one JSON answer)
    OpenAIChatUser     POST /v1/chat/completions on the OpenAI-compatible front door (--openai-url), streamed
                       with stream_options.include_usage (token counts from the usage chunk)

Each user sends one request after the other (closed loop; `--wait-time` adds think time). Prompts come from
the built-in synthetic set or `--prompts-file` (.txt / .jsonl / .json, see loadtest/workload.py); output
lengths (max_tokens, with ignore_eos so the server generates exactly that many) are drawn from
`--max-tokens-dist` clamped to [--max-tokens-min, --max-tokens-max].

What lands in Locust's own statistics (web UI, --csv, --html), one row per (Type, Name):

    Type grpc_stream / http_stream / http_generate / openai_chat, Name <model>:
        end-to-end latency per request; "size" = output tokens (Average Content Size = mean output tokens);
        ServerError and any other failure are Locust failures.
    Type TTFT, Name <user type>:   time to first token (streaming users); size = prompt tokens
    Type ITL,  Name <user type>:   inter-token latency of the request (GenAI-Perf: the gap between two
        responses divided by the tokens in the later one; per request, the token-weighted mean of its gaps,
        i.e. (last response - first response) / tokens after the first response); size = those tokens
    Type THROUGHPUT, Name output_tok/s (value, not ms) and requests/s (value, not ms): every
        --throughput-interval seconds, the output tokens and requests finished per second over that window
        (from the aggregated stats, so it is right with workers too); the "response time" columns hold the
        rate. These rows are left out with --throughput-interval 0.

At the end, the aggregate output tokens/s and requests/s over the whole run are printed and, with --csv
PREFIX, written to PREFIX_llm_summary.csv.

Headless run (bounded users, spawn rate and time):

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host http://localhost:8000 \\
        --grpc-url localhost:8001 --openai-url http://localhost:9000 --csv loadtest/results-local/run
"""

from __future__ import annotations

import csv
import http.client
import itertools
import json
import logging
import random
import time
import urllib.parse
from pathlib import Path

import gevent
from locust import User, events, task
from locust import stats as locust_stats
from locust.runners import WorkerRunner

REPO_ROOT = Path(__file__).resolve().parents[1]

from client.api import (  # noqa: E402
    Chunk,
    Completion,
    GrpcStream,
    ServerError,
    generate_http,
    gevent_compat,  # noqa: E402
    parse_sse,
    stream_http,
)
from loadtest.workload import Workload  # noqa: E402

log = logging.getLogger("llm-loadtest")

E2E_TYPES = ("grpc_stream", "http_stream", "http_generate", "openai_chat")
THROUGHPUT_TYPE = "THROUGHPUT"
TOKENS_NAME = "output_tok/s (value, not ms)"
REQUESTS_NAME = "requests/s (value, not ms)"


# ------------------------------------------------------------------------------------------------ options


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


_workload: Workload | None = None
_user_counter = itertools.count()


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    global _workload
    o = environment.parsed_options
    uniform = o.max_tokens_dist.strip().lower() in ("", "uniform")
    low = o.max_tokens_min or (16 if uniform else 1)
    high = o.max_tokens_max or (128 if uniform else 4096)
    _workload = Workload.from_options(
        prompts_file=o.prompts_file,
        dist=o.max_tokens_dist,
        low=low,
        high=high,
        use_file_lengths=not o.ignore_file_max_tokens,
        input_words=o.input_words,
        seed=o.workload_seed,
    )
    log.info("workload: %d prompts, max_tokens %r", len(_workload.samples), _workload.lengths)


def _workload_for(environment) -> Workload:
    if _workload is None:  # a user started without test_start (e.g. some library uses): build it now
        _on_test_start(environment)
    return _workload


# -------------------------------------------------------------------------------------------------- users


def _itl_ms(completion: Completion) -> tuple[float | None, int]:
    """GenAI-Perf inter-token latency of one request: (last - first data response) / tokens after the first."""
    data = [c for c in completion.chunks if c.num_tokens > 0]
    later = sum(c.num_tokens for c in data[1:])
    if len(data) < 2 or later == 0:
        return None, 0
    return (data[-1].received_at - data[0].received_at) / later * 1000.0, later


class _LLMUser(User):
    abstract = True
    request_type = ""

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.options = o
        seed = o.workload_seed
        self.rng = random.Random(seed * 1_000_003 + next(_user_counter) if seed else None)
        self.workload = _workload_for(self.environment)
        self.ignore_eos = o.ignore_eos == "true"

    def wait_time(self) -> float:
        return random.uniform(0.0, self.options.wait_time) if self.options.wait_time > 0 else 0.0

    def _params(self, max_tokens: int) -> dict:
        params = {"max_tokens": max_tokens, "temperature": self.options.temperature}
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params

    @task
    def generate(self) -> None:
        sample = self.workload.draw(self.rng)
        started = time.perf_counter()
        try:
            completion = self.call(sample.prompt, self._params(sample.max_tokens))
            self.check(completion, sample.max_tokens)
        except Exception as exc:  # ServerError (the server's message), transport errors, bad answers
            self._fire(self.request_type, self.options.model, (time.perf_counter() - started) * 1000.0, 0, exc)
            if self.options.failure_backoff > 0:
                gevent.sleep(self.options.failure_backoff)
            return
        self._report(completion)

    def call(self, prompt: str, params: dict) -> Completion:
        raise NotImplementedError

    def check(self, completion: Completion, max_tokens: int) -> None:
        n = completion.num_output_tokens
        if n < 1:
            raise ServerError("the answer has no output tokens")
        if self.ignore_eos and n != max_tokens:
            raise ServerError(f"asked for {max_tokens} tokens with ignore_eos, got {n}")

    def _report(self, c: Completion) -> None:
        self._fire(self.request_type, self.options.model, c.e2e_s * 1000.0, c.num_output_tokens)
        if self.request_type == "http_generate":
            return
        if c.ttft_s is not None:
            self._fire("TTFT", self.request_type, c.ttft_s * 1000.0, c.num_input_tokens or 0)
        itl, later_tokens = _itl_ms(c)
        if itl is not None:
            self._fire("ITL", self.request_type, itl, later_tokens)

    def _fire(self, request_type: str, name: str, ms: float, length: int, exc: BaseException | None = None) -> None:
        self.environment.events.request.fire(
            request_type=request_type,
            name=name,
            response_time=ms,
            response_length=length,
            exception=exc,
            context={"user": type(self).__name__},
        )


class GrpcStreamUser(_LLMUser):
    """Streams over gRPC with one channel (InferenceServerClient) per user, reused for its requests."""

    request_type = "grpc_stream"

    def on_start(self) -> None:
        super().on_start()
        import tritonclient.grpc as grpcclient

        self.grpc_url = self.options.grpc_url or _default_grpc_url(self.host)
        self.client = None
        self._grpcclient = grpcclient

    def on_stop(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            finally:
                self.client = None

    def call(self, prompt: str, params: dict) -> Completion:
        if self.client is None:
            gevent_compat()  # grpc on gevent before the first channel is made (GrpcStream does it too late)
            self.client = self._grpcclient.InferenceServerClient(self.grpc_url)
        stream = GrpcStream(
            prompt,
            self.grpc_url,
            self.options.model,
            stream=True,
            client=self.client,
            timeout_s=self.options.request_timeout,
            **params,
        )
        return stream.completion()


class HttpStreamUser(_LLMUser):
    """POST generate_stream and read the server-sent events as they come."""

    request_type = "http_stream"

    def call(self, prompt: str, params: dict) -> Completion:
        started = time.perf_counter()
        chunks = list(
            stream_http(
                prompt, _http_url(self.host), self.options.model, timeout_s=self.options.request_timeout, **params
            )
        )
        return Completion.from_chunks(chunks, started)


class HttpGenerateUser(_LLMUser):
    """POST generate (stream false): one JSON answer; end-to-end latency only."""

    request_type = "http_generate"

    def call(self, prompt: str, params: dict) -> Completion:
        return generate_http(
            prompt,
            _http_url(self.host),
            self.options.model,
            timeout_s=self.options.request_timeout,
            exclude_input_in_output=True,
            **params,
        )


class OpenAIChatUser(_LLMUser):
    """POST /v1/chat/completions to the front door, streamed, with the usage chunk at the end. TTFT: the first
    chunk with content; ITL: as for the other streaming users, counting each content chunk as one engine step's
    tokens (one token, or more with speculative decoding); the token counts come from the usage chunk."""

    request_type = "openai_chat"
    drop_after_chunks = 0  # > 0: close the connection after this many content chunks (a client that goes away)

    def call(self, prompt: str, params: dict) -> Completion:
        url = urllib.parse.urlsplit(self.options.openai_url or _default_openai_url(self.host))
        body = {
            "model": self.options.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "stream_options": {"include_usage": True},
            **params,
        }
        started = time.perf_counter()
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.options.request_timeout)
        chunks, usage = [], None
        try:
            conn.request(
                "POST",
                url.path.rstrip("/").removesuffix("/v1") + "/v1/chat/completions",
                body=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            response = conn.getresponse()
            if response.status != 200:
                raise ServerError(f"HTTP {response.status}: {response.read().decode(errors='replace')}")
            for payload in parse_sse(iter(response.readline, b"")):
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise ServerError(str(event["error"]))
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    text = choice["delta"].get("content") or ""
                    if text or choice["finish_reason"]:
                        chunks.append(
                            Chunk(text=text, finish_reason=choice["finish_reason"], received_at=time.perf_counter())
                        )
                if self.drop_after_chunks and len(chunks) >= self.drop_after_chunks:
                    return Completion.from_chunks(chunks, started)  # the connection closes below, mid-stream
        finally:
            conn.close()
        if usage is None:
            raise ServerError("the stream ended without a usage chunk")
        completion = Completion.from_chunks(chunks, started)
        completion.num_input_tokens = usage["prompt_tokens"]
        completion.num_output_tokens = usage["completion_tokens"]
        return completion


def _default_openai_url(host: str | None) -> str:
    return f"http://{_host_name(host)}:9000"


def _http_url(host: str | None) -> str:
    if not host:
        raise ServerError("no --host given (the HTTP endpoint, e.g. http://localhost:8000)")
    return host


def _default_grpc_url(host: str | None) -> str:
    return f"{_host_name(host)}:8001"


def _host_name(host: str | None) -> str:
    """The host name in --host (a URL or host[:port])."""
    return (
        urllib.parse.urlsplit(host if host and "//" in host else f"http://{host or 'localhost'}").hostname
        or "localhost"
    )


# ---------------------------------------------------------------------------------- throughput and summary


def _e2e_totals(environment) -> tuple[int, int, int]:
    """(requests, failures, output tokens) over the e2e rows of the (aggregated) stats."""
    requests = failures = tokens = 0
    for (_name, method), entry in environment.stats.entries.items():
        if method in E2E_TYPES:
            requests += entry.num_requests
            failures += entry.num_failures
            tokens += entry.total_content_length
    return requests, failures, tokens


def _throughput_sampler(environment, interval: float) -> None:
    last = (time.time(), 0, 0)
    while True:
        gevent.sleep(interval)
        now = time.time()
        requests, _failures, tokens = _e2e_totals(environment)
        if requests < last[1] or tokens < last[2]:  # stats were reset
            last = (now, requests, tokens)
            continue
        dt = now - last[0]
        if dt > 0 and requests > 0:
            environment.events.request.fire(
                request_type=THROUGHPUT_TYPE,
                name=TOKENS_NAME,
                response_time=(tokens - last[2]) / dt,
                response_length=tokens - last[2],
                exception=None,
                context={},
            )
            environment.events.request.fire(
                request_type=THROUGHPUT_TYPE,
                name=REQUESTS_NAME,
                response_time=(requests - last[1]) / dt,
                response_length=requests - last[1],
                exception=None,
                context={},
            )
        last = (now, requests, tokens)


_sampler: gevent.Greenlet | None = None


@events.test_start.add_listener
def _start_sampler(environment, **_kw) -> None:
    global _sampler
    interval = environment.parsed_options.throughput_interval
    if interval > 0 and not isinstance(environment.runner, WorkerRunner) and _sampler is None:
        _sampler = gevent.spawn(_throughput_sampler, environment, interval)


@events.test_stop.add_listener
def _stop_sampler(environment, **_kw) -> None:
    global _sampler
    if _sampler is not None:
        _sampler.kill(block=False)
        _sampler = None


def summary_rows(environment) -> list[dict]:
    """Per user type and in total: requests, failures, output tokens, duration, requests/s, output tokens/s."""
    stats = environment.stats
    duration = max((stats.total.last_request_timestamp or stats.total.start_time) - stats.total.start_time, 1e-9)
    rows = []
    for kind in E2E_TYPES:
        entry = stats.entries.get((environment.parsed_options.model, kind))
        if entry is None or entry.num_requests == 0:
            continue
        ok = entry.num_requests - entry.num_failures
        rows.append(
            {
                "type": kind,
                "requests": entry.num_requests,
                "failures": entry.num_failures,
                "output_tokens": entry.total_content_length,
                "duration_s": round(duration, 3),
                "requests_per_s": round(ok / duration, 4),
                "output_tokens_per_s": round(entry.total_content_length / duration, 2),
            }
        )
    requests, failures, tokens = _e2e_totals(environment)
    rows.append(
        {
            "type": "total",
            "requests": requests,
            "failures": failures,
            "output_tokens": tokens,
            "duration_s": round(duration, 3),
            "requests_per_s": round((requests - failures) / duration, 4),
            "output_tokens_per_s": round(tokens / duration, 2),
        }
    )
    return rows


@events.quitting.add_listener
def _on_quitting(environment, **_kw) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    rows = summary_rows(environment)
    lines = [
        "",
        "LLM summary (successful requests; output tokens over the run's duration):",
        f"  {'type':<14}{'requests':>9}{'failures':>9}{'out tokens':>11}{'req/s':>9}{'out tok/s':>11}",
    ]
    for r in rows:
        lines.append(
            f"  {r['type']:<14}{r['requests']:>9}{r['failures']:>9}{r['output_tokens']:>11}"
            f"{r['requests_per_s']:>9.2f}{r['output_tokens_per_s']:>11.1f}"
        )
    print("\n".join(lines), flush=True)
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        # Locust rewrites the --csv stats once a second: let it catch up with the last requests (finished while
        # the users stopped) before it closes the files.
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.2)
        path = Path(f"{prefix}_llm_summary.csv")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
