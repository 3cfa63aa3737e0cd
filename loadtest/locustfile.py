"""Locust load test for the `llm` model, calling the live server the way real clients do.

Five user types (equal weights; pick some by naming them after the options, e.g. `... GrpcStreamUser`):

    GrpcStreamUser     gRPC bi-directional streaming (tritonclient, via client/api.py GrpcStream)
    HttpStreamUser     POST /v2/models/<model>/generate_stream (server-sent events)
    HttpGenerateUser   POST /v2/models/<model>/generate (one JSON answer)
    OpenAIChatUser     POST /v1/chat/completions on the OpenAI-compatible front door (--openai-url), streamed
                       with stream_options.include_usage (token counts from the usage chunk)
    TrtllmInferUser    POST /v2/models/<--trtllm-model>/infer, unary, with TensorRT-LLM's `[1, 1]` tensors (its
                       non-decoupled tensorrt_llm_bls by default, served by llm's engine)

Each user sends one request after the other (closed loop; `--wait-time` adds think time). Prompts come from
the built-in synthetic set or `--prompts-file` (.txt / .jsonl / .json, see loadtest/workload.py); output
lengths (max_tokens, with ignore_eos so the server generates exactly that many) are drawn from
`--max-tokens-dist` clamped to [--max-tokens-min, --max-tokens-max].

What lands in Locust's own statistics (web UI, --csv, --html), one row per (Type, Name):

    Type grpc_stream / http_stream / http_generate / openai_chat / trtllm_infer, Name <model> (--model, or
        --trtllm-model for trtllm_infer):
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

import http.client
import itertools
import json
import logging
import random
import time
import urllib.parse

import gevent
from locust import User, events, task

import loadtest.locust_options  # noqa: F401  (registers the listener that adds the options)
import loadtest.throughput  # noqa: F401  (registers its Locust event listeners)
from client.api import (
    Chunk,
    Completion,
    GrpcStream,
    ServerError,
    generate_http,
    gevent_compat,
    parse_sse,
    stream_http,
)
from loadtest.workload import Workload

log = logging.getLogger("llm-loadtest")


# ----------------------------------------------------------------------------------------------- workload


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
            self._fire(self.request_type, self.model, (time.perf_counter() - started) * 1000.0, 0, exc)
            if self.options.failure_backoff > 0:
                gevent.sleep(self.options.failure_backoff)
            return
        self._report(completion)

    @property
    def model(self) -> str:
        return self.options.model

    @property
    def unary(self) -> bool:
        """One answer per request: no TTFT or ITL to report."""
        return self.request_type in ("http_generate", "trtllm_infer")

    def call(self, prompt: str, params: dict) -> Completion:
        raise NotImplementedError

    def check(self, completion: Completion, max_tokens: int) -> None:
        n = completion.num_output_tokens
        if n < 1:
            raise ServerError("the answer has no output tokens")
        if self.ignore_eos and n != max_tokens:
            raise ServerError(f"asked for {max_tokens} tokens with ignore_eos, got {n}")

    def _report(self, c: Completion) -> None:
        self._fire(self.request_type, self.model, c.e2e_s * 1000.0, c.num_output_tokens)
        if self.unary:
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


class TrtllmInferUser(_LLMUser):
    """HTTP infer (unary) as TensorRT-LLM's clients call its non-decoupled models: `[1, 1]` tensors, one JSON
    answer; ignore_eos becomes min_tokens = max_tokens (TensorRT-LLM has no ignore_eos), a temperature above 0
    samples (top_p 1: with neither top_k nor top_p TensorRT-LLM decodes greedily)."""

    request_type = "trtllm_infer"

    @property
    def model(self) -> str:
        return self.options.trtllm_model

    def call(self, prompt: str, params: dict) -> Completion:
        values = {"text_input": ("BYTES", prompt), "max_tokens": ("INT32", params["max_tokens"])}
        values["exclude_input_in_output"] = ("BOOL", True)
        values["return_num_output_tokens"] = ("BOOL", True)
        if params.get("ignore_eos"):
            values["min_tokens"] = ("INT32", params["max_tokens"])
        if params["temperature"] > 0:
            values |= {"temperature": ("FP32", params["temperature"]), "top_p": ("FP32", 1.0)}
        body = {
            "inputs": [{"name": k, "shape": [1, 1], "datatype": t, "data": [v]} for k, (t, v) in values.items()],
            "outputs": [{"name": "text_output"}, {"name": "num_output_tokens"}],
        }
        url = urllib.parse.urlsplit(_http_url(self.host))
        started = time.perf_counter()
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.options.request_timeout)
        try:
            conn.request("POST", f"/v2/models/{self.model}/infer", body=json.dumps(body).encode())
            response = conn.getresponse()
            answer = json.loads(response.read().decode(errors="replace") or "{}")
        finally:
            conn.close()
        if response.status != 200:
            raise ServerError(f"HTTP {response.status}: {answer.get('error', answer)}")
        outputs = {o["name"]: o["data"] for o in answer["outputs"]}
        ended = time.perf_counter()
        completion = Completion.from_chunks([Chunk(text=outputs["text_output"][0], received_at=ended)], started, ended)
        completion.num_output_tokens = int(outputs["num_output_tokens"][0])
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
