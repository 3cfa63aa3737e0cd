"""The HTTP client of Triton's generate extension: `generate` (whole) and `generate_stream` (server-sent events)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

from backend.protocol import wire
from client.inputs import DEFAULT_OUTPUTS, DEFAULT_TIMEOUT_S, sampling_json
from client.results import Chunk, Completion, ServerError, chunk_from_outputs


def http_body(prompt: str, stream: bool, sampling: dict | str | None = None, **params: Any) -> dict:
    """JSON body of Triton's generate extension: model inputs by name, other keys become request parameters."""
    body: dict[str, Any] = {"text_input": prompt, "stream": bool(stream)}
    text = sampling_json(sampling)
    if text is not None:
        body[wire.SAMPLING_JSON] = text
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


def _post(
    url: str, path: str, body: dict, timeout_s: float | None
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST JSON; return (connection, response) or raise ServerError with the server's message."""
    parsed = urllib.parse.urlsplit(url if "//" in url else "http://" + url)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parsed.hostname or "localhost", parsed.port, timeout=timeout_s)
    try:
        conn.request(
            "POST",
            parsed.path.rstrip("/") + path,
            body=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json"},
        )
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


def stream_http(
    prompt: str,
    url: str = "localhost:8000",
    model: str = "llm",
    *,
    stream: bool = True,
    sampling: dict | str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    **params: Any,
) -> Iterator[Chunk]:
    """Yield Chunks from POST /v2/models/{model}/generate_stream (server-sent events; DEFAULT_OUTPUTS asked).

    The stream's end is marked by one last empty Chunk with is_final=True. Closing the generator early drops
    the connection, which cancels the request on the server.
    """
    conn, response = _post(
        url,
        f"/v2/models/{model}/generate_stream",
        http_body(prompt, stream, sampling, **{**DEFAULT_OUTPUTS, **params}),
        timeout_s,
    )
    try:
        for payload in parse_sse(iter(response.readline, b"")):
            yield _http_chunk(payload, time.perf_counter(), is_final=False)
        yield Chunk(is_final=True, received_at=time.perf_counter())
    finally:
        conn.close()


def generate_http(
    prompt: str,
    url: str = "localhost:8000",
    model: str = "llm",
    *,
    sampling: dict | str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    **params: Any,
) -> Completion:
    """POST /v2/models/{model}/generate (stream false): one JSON answer as a Completion."""
    started_at = time.perf_counter()
    conn, response = _post(
        url,
        f"/v2/models/{model}/generate",
        http_body(prompt, False, sampling, **{**DEFAULT_OUTPUTS, **params}),
        timeout_s,
    )
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
