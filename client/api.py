"""Programmatic client for the decoupled `llm` model (gRPC streaming and HTTP generate endpoints).

Only the standard library, numpy and tritonclient are used, so tests and the Locust load test can import it.
The contract (tensor names, dtypes, sampling_parameters JSON) is the one the README describes.
"""

from __future__ import annotations

import http.client
import json
import queue
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from backend.protocol import wire

__all__ = [
    "DEFAULT_OUTPUTS",
    "FLAT_INPUTS",
    "Chunk",
    "Completion",
    "GrpcStream",
    "ServerError",
    "build_inputs",
    "chunk_from_outputs",
    "collect_http",
    "generate_grpc",
    "generate_http",
    "http_body",
    "parse_sse",
    "stream_grpc",
    "stream_http",
]

DEFAULT_TIMEOUT_S = 600.0

# Flat input tensors (TensorRT-LLM ensemble style): name -> (Triton datatype, numpy dtype), from the model's wire
# contract. Shape [1] except lists (stop strings, stop token ids), which are sent with shape [len].
_NUMPY = {wire.INT32: np.int32, wire.UINT64: np.uint64, wire.FP32: np.float32, wire.BOOL: np.bool_,
          wire.BYTES: np.object_}
_BOOL, _FP32, _BYTES = ((t, _NUMPY[t]) for t in (wire.BOOL, wire.FP32, wire.BYTES))
FLAT_INPUTS: dict[str, tuple[str, Any]] = {
    name: (datatype, _NUMPY[datatype]) for name, (datatype, _) in wire.INPUTS.items()
    if name not in wire.PROMPT_INPUTS and name not in (wire.SAMPLING_JSON, "stream")
}

# The model sends its additional outputs only when asked (as Triton's vLLM backend does): this client asks
# for these unless the caller says otherwise (False, or None to send no flag at all).
DEFAULT_OUTPUTS: dict[str, Any] = {
    "return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
}


class ServerError(Exception):
    """The server (or transport) reported an error for the request; str(e) is the server's message, `kind` the
    error kind it carries (backend/protocol/wire.py's ERROR_KINDS; None for transport and Triton's own errors)."""

    def __init__(self, text: str, kind: str | None = None):
        super().__init__(text)
        self.kind = kind or wire.parse_error(text)[0]


# --------------------------------------------------------------------------------------------------------------
# Results


@dataclass
class Chunk:
    """One response of the model (one streaming step, or the whole answer when not streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    sample_index: int = 0
    is_final: bool = False
    received_at: float = 0.0  # time.perf_counter() when the response arrived
    num_input_tokens: Optional[int] = None
    num_output_tokens: Optional[int] = None  # tokens in this response (the model sends the delta)
    cumulative_logprob: Optional[float] = None  # of the sample's tokens so far, when asked for
    raw: dict[str, Any] = field(default_factory=dict)  # every output, as python values

    @property
    def num_tokens(self) -> int:
        """Tokens carried by this response: output_ids if sent, else num_output_tokens, else 1 if any text."""
        if self.token_ids:
            return len(self.token_ids)
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return 1 if self.text else 0


@dataclass
class Completion:
    """A finished request, with GenAI-Perf style latencies (seconds).

    With several samples (n > 1), `samples` maps sample_index -> Completion of that sample; the top-level
    text / token_ids / finish_reason are those of the lowest sample index, num_output_tokens is the total over
    samples, ttft_s the first token of any sample and itl_s every sample's gaps. With one sample, `samples` is
    empty.
    """

    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    chunks: list[Chunk]
    num_input_tokens: Optional[int]
    num_output_tokens: int
    ttft_s: Optional[float]
    itl_s: list[float]
    e2e_s: float
    samples: dict[int, "Completion"] = field(default_factory=dict)

    @property
    def mean_itl_s(self) -> Optional[float]:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Output tokens over end-to-end latency."""
        return self.num_output_tokens / self.e2e_s if self.e2e_s > 0 else None

    @classmethod
    def from_chunks(cls, chunks: list[Chunk], started_at: float, ended_at: Optional[float] = None) -> "Completion":
        """Collect responses (any order of samples) into a Completion; `started_at` is the perf_counter at send."""
        if ended_at is None:
            ended_at = max((c.received_at for c in chunks), default=started_at)
        indices = sorted({c.sample_index for c in chunks if not _is_empty(c)}) or [0]
        if len(indices) == 1:
            return cls._one_sample(chunks, started_at, ended_at)
        samples = {
            i: cls._one_sample([c for c in chunks if c.sample_index == i], started_at, ended_at) for i in indices
        }
        first = samples[indices[0]]
        ttfts = [s.ttft_s for s in samples.values() if s.ttft_s is not None]
        return cls(
            text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason, chunks=chunks,
            num_input_tokens=first.num_input_tokens,
            num_output_tokens=sum(s.num_output_tokens for s in samples.values()),
            ttft_s=min(ttfts) if ttfts else None, itl_s=[x for s in samples.values() for x in s.itl_s],
            e2e_s=ended_at - started_at, samples=samples,
        )

    @classmethod
    def _one_sample(cls, chunks: list[Chunk], started_at: float, ended_at: float) -> "Completion":
        data = [c for c in chunks if c.num_tokens > 0]
        itl = [(b.received_at - a.received_at) / b.num_tokens for a, b in zip(data, data[1:])]
        reported = [c.num_output_tokens for c in chunks if c.num_output_tokens is not None]
        # One data response (not streaming): its num_output_tokens is the total, whatever the ids hold.
        n_out = reported[-1] if len(data) == 1 and reported else sum(c.num_tokens for c in data)
        return cls(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None),
            chunks=chunks,
            num_input_tokens=next((c.num_input_tokens for c in chunks if c.num_input_tokens is not None), None),
            num_output_tokens=n_out,
            ttft_s=data[0].received_at - started_at if data else None,
            itl_s=itl,
            e2e_s=ended_at - started_at,
        )


def _is_empty(c: Chunk) -> bool:
    return not (c.text or c.token_ids or c.finish_reason or c.num_output_tokens)


def _as_list(value: Any) -> list:
    """A numpy array, list or scalar as a flat python list (bytes decoded to str)."""
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    elif not isinstance(value, (list, tuple)):
        value = [value]
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value]


def _first_int(value: Any) -> Optional[int]:
    items = _as_list(value)
    return int(items[0]) if items else None


def chunk_from_outputs(outputs: dict[str, Any], received_at: float, is_final: bool = False,
                       sample_index: Optional[int] = None) -> Chunk:
    """Build a Chunk from a response's outputs (numpy arrays from gRPC or JSON values from HTTP)."""
    raw = {k: _as_list(v) for k, v in outputs.items()}
    if sample_index is None:
        sample_index = _first_int(outputs.get("sample_index")) or 0
    return Chunk(
        text="".join(str(t) for t in raw.get("text_output", [])),
        token_ids=[int(t) for t in raw.get("output_ids", [])],
        finish_reason=next((str(r) for r in raw.get("finish_reason", []) if r and r != "None"), None),
        sample_index=sample_index,
        is_final=is_final,
        received_at=received_at,
        num_input_tokens=_first_int(outputs.get("num_input_tokens")),
        num_output_tokens=_first_int(outputs.get("num_output_tokens")),
        cumulative_logprob=next((float(v) for v in raw.get("cumulative_logprob", [])), None),
        raw=raw,
    )


# --------------------------------------------------------------------------------------------------------------
# Request building


def _flat_spec(name: str, value: Any) -> tuple[str, Any]:
    """Datatype for a flat input: from FLAT_INPUTS, else guessed from the python value (the server judges)."""
    if name in FLAT_INPUTS:
        return FLAT_INPUTS[name]
    if isinstance(value, (bool, np.bool_)):
        return _BOOL
    if isinstance(value, int):
        return ("INT64", np.int64)
    if isinstance(value, float):
        return _FP32
    return _BYTES


def _tensor(value: Any, np_dtype: Any) -> np.ndarray:
    """Value as a 1-D array; strings (or lists of them) are utf-8 encoded for BYTES."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if np_dtype is np.object_:
        items = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in items]
    return np.array(items, dtype=np_dtype)


def _sampling_json(sampling: dict | str | None) -> Optional[str]:
    if sampling is None:
        return None
    return sampling if isinstance(sampling, str) else json.dumps(sampling)


def build_inputs(prompt: str, stream: bool = True, sampling: dict | str | None = None,
                 protocol: str = "grpc", **flat: Any) -> list:
    """InferInputs for one request: text_input, stream, sampling_parameters (JSON) and flat tensors.

    `flat` keys become tensors with the contract's dtypes (max_tokens INT32, temperature FP32, seed UINT64,
    stop BYTES [-1], flags BOOL, ...); None values are skipped. `protocol` is "grpc" or "http".
    """
    if protocol == "grpc":
        import tritonclient.grpc as tc
    elif protocol == "http":
        import tritonclient.http as tc
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    tensors: list[tuple[str, str, np.ndarray]] = [
        ("text_input", "BYTES", _tensor(prompt, np.object_)),
        ("stream", "BOOL", _tensor(bool(stream), np.bool_)),
    ]
    sampling_json = _sampling_json(sampling)
    if sampling_json is not None:
        tensors.append(("sampling_parameters", "BYTES", _tensor(sampling_json, np.object_)))
    for name, value in flat.items():
        if value is None:
            continue
        datatype, np_dtype = _flat_spec(name, value)
        tensors.append((name, datatype, _tensor(value, np_dtype)))
    inputs = []
    for name, datatype, array in tensors:
        inp = tc.InferInput(name, list(array.shape), datatype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs


# --------------------------------------------------------------------------------------------------------------
# gRPC


_gevent_ready = False


def _gevent_compat() -> None:
    """Under gevent monkey-patching (Locust), switch grpc to gevent once, else streams block the hub forever."""
    global _gevent_ready
    monkey = sys.modules.get("gevent.monkey")
    if not _gevent_ready and monkey is not None and monkey.is_module_patched("threading"):
        import grpc.experimental.gevent

        grpc.experimental.gevent.init_gevent()
        _gevent_ready = True


class GrpcStream:
    """One request over a gRPC bi-directional stream; iterate for Chunks, `cancel()` to abort.

    The request is sent when the object is made (one client and stream per request unless `client` is given).
    Iteration ends after the response flagged `triton_final_response`; an error response raises ServerError.
    Leaving the iteration early (break, close(), an exception) cancels the request on the server
    (`stop_stream(cancel_requests=True)`). Under gevent (Locust) grpc is first set up for gevent. The
    additional outputs of DEFAULT_OUTPUTS are asked for unless `flat` says otherwise.
    """

    def __init__(self, prompt: str, url: str = "localhost:8001", model: str = "llm", *, stream: bool = True,
                 sampling: dict | str | None = None, request_id: Optional[str] = None,
                 timeout_s: Optional[float] = DEFAULT_TIMEOUT_S, client: Any = None,
                 parameters: Optional[dict] = None, **flat: Any):
        _gevent_compat()
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self.chunks: list[Chunk] = []
        self.done = False
        self._queue: queue.Queue = queue.Queue()
        self._own_client = client is None
        self._client = None
        inputs = build_inputs(prompt, stream, sampling, "grpc", **{**DEFAULT_OUTPUTS, **flat})
        self._client = client if client is not None else grpcclient.InferenceServerClient(url)
        self.started_at = 0.0  # perf_counter when the request was sent
        self.ended_at: Optional[float] = None
        try:
            self._client.start_stream(callback=self._on_response)
            self.started_at = time.perf_counter()
            self._client.async_stream_infer(model, inputs, request_id=request_id or "",
                                            enable_empty_final_response=True, parameters=parameters)
        except Exception as e:
            self._close(cancel=True)
            raise ServerError(_message(e)) from e

    def _on_response(self, result: Any, error: Any) -> None:
        self._queue.put((time.perf_counter(), result, error))

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while not self.done:
                try:
                    received_at, result, error = self._queue.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise ServerError(f"no response within {self.timeout_s} s") from None
                if error is not None:
                    self.done = True  # an error is the request's final response: nothing left to cancel
                    raise ServerError(_message(error))
                chunk = _grpc_chunk(result, received_at)
                self.done = chunk.is_final
                if self.done:
                    self.ended_at = received_at
                self.chunks.append(chunk)
                yield chunk
        finally:
            self._close(cancel=not self.done)

    def cancel(self) -> None:
        """Cancel the request on the server and close the stream."""
        self._close(cancel=True)

    def completion(self) -> Completion:
        """Consume what is left and return the Completion."""
        for _ in self:
            pass
        return Completion.from_chunks(self.chunks, self.started_at, self.ended_at)

    def _close(self, cancel: bool) -> None:
        if self._client is None:
            return
        client, self._client = self._client, None
        self.done = True
        try:
            client.stop_stream(cancel_requests=cancel)
        finally:
            if self._own_client:
                client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(cancel=True)

    def __del__(self) -> None:
        try:
            self._close(cancel=True)
        except Exception:
            pass


def _message(error: Any) -> str:
    """The text of an InferenceServerException (or any exception)."""
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)


def _grpc_chunk(result: Any, received_at: float) -> Chunk:
    response = result.get_response()
    params = response.parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    sample_index = params["sample_index"].int64_param if "sample_index" in params else None
    outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
    return chunk_from_outputs(outputs, received_at, is_final=final, sample_index=sample_index)


def stream_grpc(prompt: str, url: str = "localhost:8001", model: str = "llm", **kwargs: Any) -> GrpcStream:
    """Send one request over gRPC streaming; returns an iterable GrpcStream of Chunks (see GrpcStream)."""
    return GrpcStream(prompt, url, model, **kwargs)


def generate_grpc(prompt: str, url: str = "localhost:8001", model: str = "llm", *, stream: bool = True,
                  **kwargs: Any) -> Completion:
    """Send one request over gRPC and wait for the whole Completion (stream=False: one data response)."""
    return GrpcStream(prompt, url, model, stream=stream, **kwargs).completion()


# --------------------------------------------------------------------------------------------------------------
# HTTP generate / generate_stream


def http_body(prompt: str, stream: bool, sampling: dict | str | None = None, **params: Any) -> dict:
    """JSON body of Triton's generate extension: model inputs by name, other keys become request parameters."""
    body: dict[str, Any] = {"text_input": prompt, "stream": bool(stream)}
    sampling_json = _sampling_json(sampling)
    if sampling_json is not None:
        body["sampling_parameters"] = sampling_json
    body.update({k: v for k, v in params.items() if v is not None})
    return body


def parse_sse(lines: Iterable[bytes | str]) -> Iterator[str]:
    """Yield the data of each server-sent event (multi-line data joined by newlines; comments ignored)."""
    data: list[str] = []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _post(url: str, path: str, body: dict, timeout_s: Optional[float]
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST JSON; return (connection, response) or raise ServerError with the server's message."""
    parsed = urllib.parse.urlsplit(url if "//" in url else "http://" + url)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parsed.hostname or "localhost", parsed.port, timeout=timeout_s)
    try:
        conn.request("POST", parsed.path.rstrip("/") + path, body=json.dumps(body).encode("utf-8"),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
    except OSError as e:
        conn.close()
        raise ServerError(f"cannot reach {url}: {e}") from e
    if response.status != 200:
        text = response.read().decode("utf-8", errors="replace")
        conn.close()
        message = _error_text(text)
        raise ServerError(f"HTTP {response.status}: {message}", wire.parse_error(message)[0])
    return conn, response


def _error_text(body: str) -> str:
    """The message in an error body: JSON `{"error": ...}`, the same as a server-sent event, or the raw text."""
    for payload in [body, *parse_sse(body.splitlines())]:
        try:
            return str(json.loads(payload)["error"])
        except (ValueError, KeyError, TypeError):
            pass
    return body.strip()


def _http_chunk(payload: str, received_at: float, is_final: bool) -> Chunk:
    obj = json.loads(payload)
    if "error" in obj:
        raise ServerError(str(obj["error"]))
    return chunk_from_outputs(obj, received_at, is_final=is_final)


def stream_http(prompt: str, url: str = "localhost:8000", model: str = "llm", *, stream: bool = True,
                sampling: dict | str | None = None, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
                **params: Any) -> Iterator[Chunk]:
    """Yield Chunks from POST /v2/models/{model}/generate_stream (server-sent events; DEFAULT_OUTPUTS asked).

    The stream's end is marked by one last empty Chunk with is_final=True. Closing the generator early drops
    the connection, which cancels the request on the server.
    """
    conn, response = _post(url, f"/v2/models/{model}/generate_stream",
                           http_body(prompt, stream, sampling, **{**DEFAULT_OUTPUTS, **params}), timeout_s)
    try:
        for payload in parse_sse(iter(response.readline, b"")):
            yield _http_chunk(payload, time.perf_counter(), is_final=False)
        yield Chunk(is_final=True, received_at=time.perf_counter())
    finally:
        conn.close()


def generate_http(prompt: str, url: str = "localhost:8000", model: str = "llm", *,
                  sampling: dict | str | None = None, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
                  **params: Any) -> Completion:
    """POST /v2/models/{model}/generate (stream false): one JSON answer as a Completion."""
    started_at = time.perf_counter()
    conn, response = _post(url, f"/v2/models/{model}/generate",
                           http_body(prompt, False, sampling, **{**DEFAULT_OUTPUTS, **params}), timeout_s)
    try:
        payload = response.read().decode("utf-8")
    finally:
        conn.close()
    chunk = _http_chunk(payload, time.perf_counter(), is_final=True)
    return Completion.from_chunks([chunk], started_at, chunk.received_at)


def collect_http(prompt: str, url: str = "localhost:8000", model: str = "llm", **kwargs: Any) -> Completion:
    """Stream over generate_stream and return the Completion (TTFT / ITL measured from the events)."""
    started_at = time.perf_counter()
    chunks = list(stream_http(prompt, url, model, **kwargs))
    return Completion.from_chunks(chunks, started_at)
